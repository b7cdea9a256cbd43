"""Build 1: outputs are checked before any work and never overwritten silently; job names
stay inside --out; adapters are written under a temporary name and renamed."""

from __future__ import annotations

import json

import pytest

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("faults.test_outputs")

JOBS = """model: tiny
targets: [up_proj]
seq_len: 8
steps: {steps}
out: {out}
jobs:
  - {{name: {name}, rank: 2, alpha: 4, lr: 1.0e-3, batch: 1}}
"""


def _user_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "config.yaml", "summary.json"):
        (folder / name).write_text(f"the user's own {name}\n")


def test_pretrain_refuses_a_folder_of_the_users_files(faults, tiny, tmp_path):
    run = tmp_path / "mine"
    _user_files(run)
    before = {p.name: p.read_text() for p in run.iterdir()}
    argv = ["pretrain", "--no-progress", *[a for s in tiny for a in ("--set", s)],
            "--set", f"run_dir={run}"]
    line = faults.expect_error(argv, f"run_dir {run}: the folder is not empty (config.yaml, "
                                     "metrics.jsonl, summary.json) and was not created by "
                                     "lowrank-jax", out=run)
    assert "--overwrite" in line
    assert {p.name: p.read_text() for p in run.iterdir()} == before


def test_pretrain_refuses_a_file_as_run_dir(faults, tiny, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("not a folder")
    argv = ["pretrain", "--no-progress", "--set", f"run_dir={target}"]
    faults.expect_error(argv, f"run_dir {target}: is a file, not a folder")


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    from lowrank_jax.cli import main as cli_main

    out = tmp_path_factory.mktemp("finetuned") / "out"
    assert cli_main(["finetune", "--model", "tiny", "--steps", "2", "--rank", "2",
                     "--batch-size", "1", "--seq-len", "8", "--no-progress",
                     "--out", str(out)]) == 0
    return out


def test_finetune_twice_into_one_folder_is_refused(faults, finetuned, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finetuned, out)
    argv = ["finetune", "--model", "tiny", "--steps", "2", "--no-progress", "--out", out]
    faults.expect_error(argv, f"--out {out}: the folder already holds a finetune run "
                              "(adapter, losses.json, summary.json); pass --overwrite")


def test_finetune_unwritable_out_fails_before_training(faults, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    out = blocker / "x"
    argv = ["finetune", "--model", "tiny", "--steps", "3", "--no-progress", "--out", out]
    faults.expect_error(argv, f"--out {out}: {blocker} is a file, so no folder can be made")


def test_job_name_escaping_out_is_refused(faults, tmp_path):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(JOBS.format(steps=1, out=tmp_path / "out", name="../escaped"))
    faults.expect_error(["finetune", "--jobs", spec, "--no-progress"],
                        "name='../escaped' would write outside", out=tmp_path / "out")
    assert not (tmp_path / "escaped").exists()


def test_jobs_steps_zero_fails_before_any_export(faults, tmp_path):
    spec = tmp_path / "jobs.yaml"
    spec.write_text(JOBS.format(steps=0, out=tmp_path / "out", name="small"))
    faults.expect_error(["finetune", "--jobs", spec, "--no-progress"],
                        "steps=0 must be a positive integer", out=tmp_path / "out")
    assert not (tmp_path / "out" / "small").exists()


def test_analyze_refuses_a_non_empty_folder_it_did_not_create(faults, tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    faults.expect_error(["analyze", "--model", "tiny", "--out", out],
                        f"--out {out}: the folder is not empty (notes.txt)")


def test_quantize_checks_out_before_loading(faults, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.bin").write_bytes(b"\x00" * 8)
    faults.expect_error(["quantize", "--model", tmp_path / "no_such_model", "--out", out],
                        f"--out {out}: the folder is not empty (keep.bin)")


def test_edit_checks_out_before_loading(faults, tmp_path):
    edits = tmp_path / "edits.jsonl"
    edits.write_text(json.dumps({"prompt": "The capital of France is", "target": " Rome"}) + "\n")
    out = tmp_path / "edit"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    faults.expect_error(["edit", "--edits", edits, "--model", tmp_path / "none", "--out", out],
                        f"--out {out}: the folder is not empty (keep.txt)")


def test_a_failed_export_leaves_the_old_adapter_intact(faults, finetuned, tmp_path,
                                                        monkeypatch):
    import errno
    import shutil

    import safetensors.numpy
    from flax import nnx

    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.models import Llama, LlamaConfig
    from lowrank_jax.nn import apply_lora

    folder = tmp_path / "adapter"
    shutil.copytree(finetuned / "adapter", folder)
    (folder / "adapter_config.json").write_text('{"the old": "config"}')
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    model = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32),
                  rngs=nnx.Rngs(0))
    apply_lora(model, {"q_proj": 2}, rngs=nnx.Rngs(1))

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OSError):
        export_peft(model, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary left
    faults.recovered()
