"""Issue 51, findings 1, 3, 4, 6 and 9 (last item): one rule for every output path, folders
that load, work kept when the last step fails, a full disk in every command.

- ``--save-merged`` / ``--save-base`` obey the rule of ``--out``: never into a folder the
  command did not create, never over a run without ``--overwrite`` (finding 1);
- every kind of model folder the tools write loads with ``--model`` and its tokenizer and
  generates (finding 3);
- a failing ``--save-merged`` after training keeps the adapter and summary and names the
  command to run next; an internal bug exits 1, a full disk exits 2 (findings 4 and 6);
- a full disk while a command writes a model: one line, exit 2, nothing partial (finding 6);
- a command that fails on an argument after claiming its output leaves no marker-only folder
  (finding 9).
"""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.xdist_group("faults.test_output_rule")

FINETUNE = ["finetune", "--model", "tiny", "--steps", "2", "--rank", "2", "--batch-size", "1",
            "--seq-len", "8", "--no-progress"]
FULL_DISK = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
             '"No space left on device" })')


def _full_disk_for(monkeypatch, name="model.safetensors"):
    """safetensors reports a full disk (as its Rust core does) when writing a file ``name``."""
    import safetensors.numpy
    from safetensors import SafetensorError

    real = safetensors.numpy.save_file

    def save_file(tensors, filename, *args, **kwargs):
        if str(filename).endswith("/" + name):
            raise SafetensorError(FULL_DISK)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, salaad_run):
    """One folder of every kind the commands write, from the tiny model."""
    from lowrank_jax.cli import main as cli_main

    def main(argv):
        return cli_main([str(a) for a in argv])

    base = tmp_path_factory.mktemp("folders")
    work = {name: base / name for name in ("ft", "merged", "nf4", "nf4_base", "merge_fp",
                                           "merge_q", "quantized", "export")}
    assert main([*FINETUNE, "--out", work["ft"], "--save-merged", work["merged"]]) == 0
    assert main([*FINETUNE, "--quantize", "nf4", "--out", work["nf4"], "--save-base",
                 work["nf4_base"]]) == 0
    for to, name in (("fp", "merge_fp"), ("quantized", "merge_q")):
        assert main(["merge", "--model", "tiny", "--quantize", "nf4", "--adapter",
                     work["nf4"] / "adapter", "--to", to, "--eval-tokens", "64", "--out",
                     work[name]]) == 0
    assert main(["quantize", "--model", "tiny", "--method", "rtn", "--bits", "4", "--out",
                 work["quantized"]]) == 0
    assert main(["export", "--run", salaad_run, "--budget", "0.5", "--out", work["export"]]) == 0
    return work


KINDS = {
    "finetune --save-merged": "merged",
    "finetune --quantize nf4 --save-base": "nf4_base",
    "merge --to fp (NF4 byte-level base)": "merge_fp/model",
    "merge --to quantized (NF4 byte-level base)": "merge_q/model",
    "quantize --out": "quantized",
    "export --out": "export",
    "finetune --out/adapter (a PEFT folder)": "ft/adapter",
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_folder_the_tools_write_loads_and_generates(faults, folders, kind):
    """Finding 3: each folder loads with --model, tokenizer included, and generates."""
    folder = folders[KINDS[kind].split("/")[0]] / "/".join(KINDS[kind].split("/")[1:])
    code, out, err = faults.cli(["generate", "--model", folder, "--prompt", "The", "--raw",
                                 "--max-new-tokens", "3"])
    assert code == 0, err
    assert "[stopped: 3 new tokens]" in err
    faults.recovered()


@pytest.mark.parametrize("flag", ["--save-merged", "--save-base"])
def test_extra_output_refuses_a_folder_holding_another_model(faults, tmp_path, flag):
    """Finding 1: --save-merged / --save-base never write into a folder they did not create
    (here one holding another model), and refuse before any training."""
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"\x00" * 64)
    extra = ["--quantize", "nf4"] if flag == "--save-base" else []
    faults.expect_error([*FINETUNE, *extra, "--out", tmp_path / "o", flag, other],
                        f"{flag} {other}: the folder is not empty (config.json, "
                        "model.safetensors) and was not created by lowrank-jax")
    assert not (tmp_path / "o").exists()  # the --out it claimed first is not left behind


def test_save_merged_twice_needs_overwrite(faults, folders, tmp_path):
    """Finding 1: a merged folder of an earlier run is replaced only with --overwrite."""
    merged = tmp_path / "merged"
    shutil.copytree(folders["merged"], merged)
    faults.expect_error([*FINETUNE, "--out", tmp_path / "o", "--save-merged", merged],
                        f"--save-merged {merged}: the folder already holds a finetune run")


def test_a_failing_merge_keeps_the_adapter_and_names_the_next_command(faults, tmp_path,
                                                                      monkeypatch):
    """Finding 4: a bug in the last step (here the two-merges bug of NF4) exits 1 with
    'internal error', after the adapter and summary are written; the advised command works."""
    import lowrank_jax.train.finetune as finetune_lib

    def broken_merge(model, folder):
        raise ValueError("quantize_model: found a QLoRALinear projection at layers/0/q_proj")

    monkeypatch.setattr(finetune_lib, "save_merged", broken_merge)
    work = tmp_path / "work"
    out, merged = work / "o", work / "merged"
    code, _, err = faults.cli([*FINETUNE, "--out", out, "--save-merged", merged], out=work)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("lowrank-jax finetune: internal error (RuntimeError: "
                               f"--save-merged {merged}: not written (ValueError: quantize_model")
    advice = f"lowrank-jax merge --model tiny --adapter {out / 'adapter'} --to fp --out MERGED"
    assert f"the adapter and summary.json are saved in {out}; merge later with `{advice}`" \
        in lines[0]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert not merged.exists()  # nothing partial
    monkeypatch.undo()
    code, _, err = faults.cli(advice.split()[1:-1] + [work / "later", "--eval-tokens", "64"],
                              out=work)  # the advised command (a short perplexity check)
    assert code == 0, err
    code, _, err = faults.cli(["generate", "--model", work / "later" / "model", "--prompt", "a",
                               "--raw", "--max-new-tokens", "2"], out=work)
    assert code == 0, err
    faults.clear_error()


def test_full_disk_while_saving_the_merged_model(faults, tmp_path, monkeypatch):
    """Findings 4 and 6: a full disk during --save-merged is one line, exit 2, no partial
    merged folder; the adapter and summary are kept and the line says how to merge later."""
    _full_disk_for(monkeypatch)
    work = tmp_path / "work"
    out, merged = work / "o", work / "merged"
    line = faults.expect_error([*FINETUNE, "--out", out, "--save-merged", merged],
                               "no space left on device", out=work)
    assert line.startswith(f"lowrank-jax finetune: error: --save-merged {merged}: not written")
    assert f"merge later with `lowrank-jax merge --model tiny --adapter {out / 'adapter'}" in line
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "summary.json").is_file()
    assert sorted(p.name for p in work.iterdir()) == ["o"]  # no merged folder, no temporary


@pytest.mark.parametrize("command", ["merge", "quantize", "export"])
def test_full_disk_while_writing_a_model_is_one_line_and_leaves_nothing(faults, folders,
                                                                        salaad_run, tmp_path,
                                                                        monkeypatch, command):
    """Finding 6: every command that writes a model: one line, exit 2, nothing partial."""
    _full_disk_for(monkeypatch)
    out = tmp_path / "out"
    argv = {"merge": ["merge", "--model", "tiny", "--quantize", "nf4", "--adapter",
                      folders["nf4"] / "adapter", "--to", "fp", "--eval-tokens", "64"],
            "quantize": ["quantize", "--model", "tiny", "--method", "rtn", "--bits", "4"],
            "export": ["export", "--run", salaad_run, "--budget", "0.5"]}
    code, _, err = faults.cli([*argv[command], "--out", out])  # quantize: its progress bar
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        f"lowrank-jax {command}: error: no space left on device; free disk space or choose a "
        "folder on another disk.")
    assert not out.exists()
    faults.clear_error()


def test_an_argument_error_after_claiming_out_leaves_no_folder(faults, tmp_path):
    """Finding 9: a check that fails after --out was claimed leaves no marker-only folder."""
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    faults.expect_error([*FINETUNE, "--data", short, "--out", tmp_path / "o"],
                        "--data has 4 tokens, fewer than --seq-len + 2 = 10")
    assert not (tmp_path / "o").exists()
