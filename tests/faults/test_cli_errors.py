"""Build 3: one error boundary. Every user mistake exits 2 with one line naming the argument,
file or key; config numbers parse as YAML 1.2; tracebacks only with --debug."""

from __future__ import annotations

import pytest

from lowrank_jax.train import load_config


@pytest.mark.parametrize("value, expected", [("1e-3", 1e-3), ("3E-4", 3e-4), ("5E-2", 0.05)])
def test_scientific_notation_is_a_float(faults, value, expected):
    cfg = load_config("tiny", [f"optimizer.learning_rate={value}"])
    assert cfg.optimizer.learning_rate == pytest.approx(expected)
    assert isinstance(cfg.optimizer.learning_rate, float)
    faults.recovered()


def test_yaml_file_numbers_are_read_as_yaml_1_2(faults, tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("optimizer:\n  learning_rate: 1e-3\n  adamw_learning_rate: 5E-4\n"
                      "train:\n  steps: 1e2\n")
    cfg = load_config(str(preset))
    assert (cfg.optimizer.learning_rate, cfg.optimizer.adamw_learning_rate) == (1e-3, 5e-4)
    assert cfg.train.steps == 100 and isinstance(cfg.train.steps, int)
    faults.recovered()


def test_malformed_yaml_config_names_file_and_line(faults, tmp_path):
    preset = tmp_path / "bad.yaml"
    preset.write_text("model:\n  d_model: 64\n   n_layers: [2\n")
    faults.expect_error(["pretrain", "--config", preset],
                        f"--config {preset}: invalid YAML at line 3")


def test_yaml_list_config_is_one_line(faults, tmp_path):
    preset = tmp_path / "list.yaml"
    preset.write_text("- model\n- train\n")
    faults.expect_error(["pretrain", "--config", preset],
                        f"--config {preset}: expected a mapping of sections")


def test_config_that_is_a_folder_is_one_line(faults, tmp_path):
    folder = tmp_path / "configs_dir"
    folder.mkdir()
    faults.expect_error(["pretrain", "--config", folder], "is a directory")


def test_bad_regex_names_the_argument(faults):
    faults.expect_error(["analyze", "--model", "tiny", "--layers", "("],
                        "--layers '(' is not a valid regular expression")


def test_bad_targets_regex_names_the_argument(faults):
    faults.expect_error(["finetune", "--model", "tiny", "--targets", "q_proj[",
                         "--no-progress"], "--targets 'q_proj[' is not a valid regular")


@pytest.mark.parametrize("command", [
    ["finetune", "--model", "tiny", "--no-progress", "--out", "out", "--data"],
    ["eval", "--model", "no_such_model", "--text"],
    ["quantize", "--model", "no_such_model", "--out", "q", "--calib-file"],
    ["edit", "--model", "no_such_model", "--out", "e", "--edits"],
], ids=["finetune --data", "eval --text", "quantize --calib-file", "edit --edits"])
def test_non_utf8_input_names_the_file(faults, tmp_path, command):
    data = tmp_path / "latin1.txt"
    data.write_bytes("caf\xe9 au lait ".encode("latin-1") * 50)
    faults.expect_error([*command, data],
                        f"{command[-1]} {data}: not UTF-8 text (byte 0xe9 at offset 3)")


def test_usage_errors_are_one_line(faults):
    faults.expect_error(["finetune", "--lr", "-1"], "argument --lr: -1.0 must be > 0")


def test_unexpected_errors_are_one_line_without_debug(faults, monkeypatch):
    from lowrank_jax.commands import plan

    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(plan, "run", broken)  # a bug in a command (register reads plan.run)
    code, _, err = faults.cli(["plan", "--devices", "1"])
    assert code == 1
    assert err.strip().splitlines() == [(
        "lowrank-jax plan: internal error (TypeError: unsupported operand); rerun with --debug "
        "for the traceback and report it.")]
    assert "Traceback" not in err
    faults.clear_error()
    with pytest.raises(TypeError):
        from lowrank_jax.cli import main

        main(["--debug", "plan", "--devices", "1"])
