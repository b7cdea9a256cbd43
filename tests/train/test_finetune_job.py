"""``FinetuneJob``: the Python face of ``lowrank-jax finetune``, with its defaults and its files;
``lowrank-jax jobs``; library messages that name parameters, shown by the CLI as flags."""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from lowrank_jax.cli import as_flags, build_parser, command_flags
from lowrank_jax.cli import main as cli_main
from lowrank_jax.train import FinetuneJob, JobResult

SMALL = dict(model="tiny", steps=2, batch_size=2, seq_len=16, rank=2, targets="v_proj")


def _adapter(folder):
    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def test_python_job_writes_the_adapter_and_summary_of_the_cli(tmp_path):
    cli = ["finetune", "--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
           "--rank", "2", "--targets", "v_proj", "--no-progress", "--out", str(tmp_path / "cli")]
    assert cli_main(cli) == 0
    result = FinetuneJob(**SMALL, out=str(tmp_path / "py"), progress=False).run(log=None)
    assert isinstance(result, JobResult) and result.adapter == str(tmp_path / "py" / "adapter")
    assert result.lr == 1e-3 and len(result.result.losses) == 2
    by_cli, by_python = _adapter(tmp_path / "cli"), _adapter(tmp_path / "py")
    assert sorted(by_cli) == sorted(by_python) and len(by_cli) == 4  # 2 layers x (A, B)
    for key, value in by_cli.items():
        np.testing.assert_array_equal(by_python[key], value, err_msg=key)
    assert any(np.abs(v).max() > 0 for k, v in by_python.items() if "lora_B" in k)  # trained
    summary = json.loads((tmp_path / "py" / "summary.json").read_text())
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary == result.summary | {"seconds": summary["seconds"]}
    assert {k: v for k, v in summary.items() if k != "seconds"} == \
        {k: v for k, v in cli_summary.items() if k != "seconds"}
    assert json.loads((tmp_path / "py" / "losses.json").read_text()) == result.result.losses


def test_quantize_and_save_base_run_from_python(tmp_path):
    job = FinetuneJob(**SMALL, quantize="nf4", save_base=str(tmp_path / "base"),
                      out=str(tmp_path / "o"), progress=False)
    lines = []
    result = job.run(log=lines.append)
    assert result.summary["quantize"] == "nf4" and result.saved_base == str(tmp_path / "base")
    assert result.summary["memory_bytes"] and (tmp_path / "base" / "quantization.json").is_file()
    assert lines[0] == f"quantized base: {tmp_path / 'base'}" and "PEFT adapter" in lines[-1]


def test_rank_plan_runs_from_python(tmp_path):
    job = FinetuneJob(**{**SMALL, "targets": "(q|v)_proj", "rank": 4}, rank_plan=True,
                      out=str(tmp_path / "o"), progress=False)
    result = job.run(log=None)
    ranks = result.result.ranks
    assert result.summary["probe_scores"] and len(ranks) == 4
    assert all(1 <= r <= 16 for r in ranks.values()) and sum(ranks.values()) <= 4 * len(ranks)


@pytest.mark.parametrize("fields, message", [
    ({"batch_size": 0}, "batch_size=0: must be a positive integer, e.g. batch_size=8"),
    ({"steps": 1.5}, "steps=1.5: must be a positive integer"),
    ({"lr": -1.0}, "lr=-1.0: must be a finite number > 0, e.g. lr=0.001"),
    ({"alpha": float("nan")}, "alpha=nan: must be a finite number > 0"),
    ({"seed": -1}, "seed=-1: must be an integer >= 0"),
    ({"method": "dora"}, "method='dora': unknown; use one of lora, balora"),
    ({"quantize": "int3"}, "quantize='int3': unknown; use one of nf4, rtn4, unisvq2"),
    ({"targets": "("}, "`targets` '(' is not a valid regular expression"),
    ({"save_base": "b"}, "`save_base` writes the quantized base; it needs `quantize`"),
    ({"quantize": "nf4", "method": "pissa"},
     "`method` pissa rewrites the base weights; with `quantize` use lora, balora or lokra"),
    ({"quantize": "nf4", "rank_plan": True}, "`rank_plan` probes the dense linear layers"),
])
def test_bad_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError) as error:
        FinetuneJob(**fields)
    assert message in str(error.value) and "--" not in str(error.value)


def test_the_job_is_frozen_and_resolves_the_method_lr():
    job = FinetuneJob(method="balora")
    assert job.learning_rate == 1e-4 and FinetuneJob(lr=0.01).learning_rate == 0.01
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.rank = 4


def test_cli_shows_parameters_as_its_flags():
    flags = command_flags(build_parser(), "finetune")
    assert flags["batch_size"] == "--batch-size" and flags["save_merged"] == "--save-merged"
    assert "jobs" in flags and command_flags(build_parser(), "jobs").get("jobs") is None
    assert as_flags("batch_size=0: must be a positive integer, e.g. batch_size=8.", flags) == \
        "--batch-size 0: must be a positive integer, e.g. batch_size=8."
    assert as_flags("`data` has 4 tokens, fewer than `seq_len` + 2; lower `lr`.", flags) == \
        "--data has 4 tokens, fewer than --seq-len + 2; lower --lr."
    # only names of the command's options, only in backquotes or leading `name=`
    assert as_flags("data has 4 tokens; `nope` and `lowrank-jax merge --model x`.", flags) == \
        "data has 4 tokens; `nope` and `lowrank-jax merge --model x`."
    assert as_flags("job 'a' lr=nan must be > 0", flags) == "job 'a' lr=nan must be > 0"


def test_cli_short_text_names_the_flags(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("abcd")
    assert cli_main(["finetune", "--data", str(text), "--seq-len", "8", "--no-progress",
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lowrank-jax finetune: error: --data has 4 tokens, fewer than --seq-len + 2 "
                   "= 10; pass more text or a smaller --seq-len.")
    with pytest.raises(ValueError, match=r"^`data` has 4 tokens, fewer than `seq_len` \+ 2"):
        FinetuneJob(data=str(text), seq_len=8, out=str(tmp_path / "p"), progress=False).run()


def test_jobs_command_equals_finetune_jobs(tmp_path):
    spec = tmp_path / "jobs.yaml"
    spec.write_text("model: tiny\ntargets: [v_proj]\nseq_len: 16\nsteps: 2\n"
                    "jobs:\n  - {name: a, rank: 2, batch: 1}\n")  # packing: test_jobs_cli.py
    assert cli_main(["jobs", str(spec), "--out", str(tmp_path / "j"), "--no-progress"]) == 0
    assert cli_main(["finetune", "--jobs", str(spec), "--out", str(tmp_path / "f"),
                     "--no-progress"]) == 0
    for name in ("a",):
        by_jobs, by_finetune = _adapter(tmp_path / "j" / name), _adapter(tmp_path / "f" / name)
        assert sorted(by_jobs) == sorted(by_finetune)
        for key, value in by_jobs.items():
            np.testing.assert_array_equal(by_finetune[key], value, err_msg=key)
    summary = json.loads((tmp_path / "j" / "jobs_summary.json").read_text())
    assert [j["rank"] for j in summary["jobs"]] == [2] and len(summary["history"]) == 2
