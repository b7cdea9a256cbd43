"""``lowrank-jax finetune --jobs``: K packed jobs, one PEFT adapter per job, validated input."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from lowrank_jax.cli import main as cli_main

SPEC = """model: tiny
targets: [up_proj, down_proj]
seq_len: 16
steps: 3
out: {out}
jobs:
  - {{name: small, rank: 2, alpha: 4, lr: 3.0e-3, batch: 1}}
  - {{name: big, rank: 6, alpha: 12, lr: 1.0e-3, batch: 2}}
"""


def test_jobs_train_and_export_one_adapter_per_job(tmp_path):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(SPEC.format(out=tmp_path / "out"))
    assert cli_main(["finetune", "--jobs", str(spec), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "jobs_summary.json").read_text())
    assert [j["name"] for j in summary["jobs"]] == ["small", "big"]
    assert len(summary["history"]) == 3 and all(len(h) == 2 for h in summary["history"])
    for name, rank in (("small", 2), ("big", 6)):
        folder = tmp_path / "out" / name / "adapter"
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == rank and config["peft_type"] == "LORA"
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        a = tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]
        b = tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
        assert a.shape == (rank, 64) and b.shape == (128, rank)
        assert np.abs(b).max() > 0  # trained: B moved away from its zero init


@pytest.mark.parametrize("body, message", [
    ("jobs: []", "no jobs listed"),
    ("jobs:\n  - {name: a, rnk: 2}", "unknown keys ['rnk']"),
    ("jobs:\n  - {name: a}\n  - {name: a}", "two jobs are named 'a'"),
    ("jobs:\n  - {name: a, lr: -1}", "lr=-1 must be > 0"),
])
def test_bad_jobs_files_fail_with_one_line(tmp_path, capsys, body, message):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(body)
    assert cli_main(["finetune", "--jobs", str(spec), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flags, named", [
    (["--rank", "4"], "--rank"),
    (["--method", "balora", "--lr", "1e-3", "--data", "x.txt"], "--method, --data, --lr"),
    (["--quantize", "nf4"], "--quantize"),
])
def test_flags_that_jobs_would_ignore_are_refused_by_name(tmp_path, capsys, flags, named):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(SPEC.format(out=tmp_path / "out"))
    assert cli_main(["finetune", "--jobs", str(spec), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert f"{named} would be ignored" in err and "jobs.yaml" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_only_process_0_writes_the_jobs_files(tmp_path, monkeypatch):
    """Under several processes every process trains the same jobs; process 0 alone writes."""
    from lowrank_jax.train import multihost
    from lowrank_jax.train.jobs import load_jobs, run_jobs

    spec = tmp_path / "jobs.yaml"
    spec.write_text(SPEC.format(out=tmp_path / "out").replace("steps: 3", "steps: 1"))
    monkeypatch.setattr(multihost, "is_main_process", lambda: False)
    summary = run_jobs(load_jobs(str(spec)), progress=False, log=lambda *_: None)
    assert not (tmp_path / "out").exists()  # nothing written off process 0
    assert [row["name"] for row in summary] == ["small", "big"]
    assert all(np.isfinite(row["final_loss"]) for row in summary)
    assert summary[0]["adapter"] == str(tmp_path / "out" / "small" / "adapter")
