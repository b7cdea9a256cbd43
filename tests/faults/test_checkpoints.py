"""Build 2: damaged checkpoints fall back to the newest good step, changed configs are named,
metrics have no duplicates after a resume, saves survive a second interrupt and a full disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from lowrank_jax.train import init_state, load_config


def _data_files(step_dir):
    return sorted((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: (-p.stat().st_size, str(p)))


def _flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "data file deleted": lambda s: _data_files(s)[0].unlink(),
    "data file truncated": lambda s: _data_files(s)[0].write_bytes(
        _data_files(s)[0].read_bytes()[:16]),
    "64 bytes flipped": lambda s: _flip(_data_files(s)[0]),
    "_METADATA emptied": lambda s: (s / "default" / "_METADATA").write_text(""),
    "_METADATA missing": lambda s: (s / "default" / "_METADATA").unlink(),
    "default/ missing": lambda s: shutil.rmtree(s / "default"),
    "manifests deleted": lambda s: [p.unlink() for p in s.rglob("manifest.ocdbt")],
}


def _copy(run, tmp_path, name="run"):
    target = tmp_path / name
    shutil.copytree(run, target)
    return target


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_step_falls_back_to_the_previous_one(faults, tiny_runs, tiny, tmp_path,
                                                            damage):
    from lowrank_jax.io.checkpoint import checkpoint_manager, restore_checkpoint

    run = _copy(tiny_runs["split"], tmp_path)
    DAMAGE[damage](run / "checkpoints" / "4")
    cfg = load_config("tiny", tiny + [f"run_dir={run}"])
    state, _ = init_state(cfg)
    messages = []
    restored, manager = restore_checkpoint(checkpoint_manager(run), state, cfg,
                                           log=messages.append)
    assert restored.step == 2
    assert len(messages) == 1 and messages[0].startswith("step 4 is corrupt ("), messages
    assert "); resuming from step 2" in messages[0]
    assert manager.all_steps() == [2]
    assert (run / "corrupt_checkpoints" / "4").is_dir()  # moved aside, never deleted
    # the restored arrays are exactly those saved at step 2 (checked against the checksums)
    record = json.loads((run / "checkpoints" / "2" / "lowrank_jax_integrity.json").read_text())
    from lowrank_jax.io.checkpoint import checksums

    assert checksums({"params": restored.params, "opt_state": restored.opt_state}) == \
        record["checksums"]
    faults.recovered()


def test_resume_after_damage_continues_bit_identically(faults, tiny_runs, tiny, tmp_path):
    run = _copy(tiny_runs["split"], tmp_path, "split")
    _flip(_data_files(run / "checkpoints" / "4")[0])
    with open(run / "metrics.jsonl", "a") as f:  # rows a kill -9 left after the checkpoint
        f.write(json.dumps({"kind": "train", "step": 5, "loss": 1.0}) + "\n")
    code, out, err = faults.cli(["pretrain", "--no-progress", "--resume", "--set",
                                 f"run_dir={run}", *[a for s in tiny for a in ("--set", s)]],
                                out=run)
    assert code == 0, err
    # where the flipped bytes land decides the detector: the checksums (raw chunk bytes) or
    # TensorStore itself (a compressed chunk or its index); either names step 4 and moves on
    assert "step 4 is corrupt (" in out and "; resuming from step 2" in out
    full = tiny_runs["full_result"].state
    from lowrank_jax.io.checkpoint import checkpoint_manager, restore_checkpoint

    cfg = load_config("tiny", tiny + [f"run_dir={run}"])
    state, _ = restore_checkpoint(checkpoint_manager(run), init_state(cfg)[0], cfg)
    assert state.step == 6
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # metrics: no duplicated or stale rows; the losses equal the uninterrupted run's
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (tiny_runs["full"] / "metrics.jsonl").read_text().splitlines()]
    train_rows = lambda rs: [(r["step"], r["loss"]) for r in rs if r["kind"] == "train"]
    assert train_rows(rows) == train_rows(ref)
    faults.recovered()


@pytest.mark.parametrize("change, message", [
    ("model.d_model=32", "model.d_model 16 -> 32"),
    ("optimizer.name=sgd", "optimizer.name adamw -> sgd"),
])
def test_resume_with_another_config_names_what_differs(faults, tiny_runs, tiny, tmp_path, change,
                                                       message):
    run = _copy(tiny_runs["split"], tmp_path)
    argv = ["pretrain", "--no-progress", "--resume", *[a for s in tiny for a in ("--set", s)],
            "--set", f"run_dir={run}", "--set", change]
    line = faults.expect_error(argv, message, out=run)
    assert "was saved with a different configuration" in line
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]  # nothing moved or deleted


def test_every_step_damaged_is_one_line(faults, tiny_runs, tiny, tmp_path):
    run = _copy(tiny_runs["split"], tmp_path)
    for step in ("2", "4"):
        shutil.rmtree(run / "checkpoints" / step / "default")
    argv = ["pretrain", "--no-progress", "--resume", *[a for s in tiny for a in ("--set", s)],
            "--set", f"run_dir={run}"]
    faults.expect_error(argv, "every checkpoint in", out=run)
    assert sorted(os.listdir(run / "corrupt_checkpoints")) == ["2", "4"]


def test_interrupt_during_a_save_waits_for_it(faults, tiny_runs, tiny, tmp_path):
    import orbax.checkpoint as ocp

    from lowrank_jax.io.checkpoint import checkpoint_manager, save_checkpoint

    run = _copy(tiny_runs["split"], tmp_path)
    cfg = load_config("tiny", tiny + [f"run_dir={run}"])
    state, _ = init_state(cfg)
    state = type(state)(state.graphdef, state.params, state.opt_state, 5)
    manager = checkpoint_manager(run)
    real_save = manager.save

    def save_with_ctrl_c(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again mid-save
        return real_save(*args, **kwargs)

    manager.save = save_with_ctrl_c
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # raised once the step is complete on disk
        save_checkpoint(manager, state, cfg)
    assert 5 in ocp.CheckpointManager(run / "checkpoints").all_steps()
    assert (run / "checkpoints" / "5" / "lowrank_jax_integrity.json").exists()
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C works again after the save
    faults.recovered()


def test_disk_full_during_a_checkpoint_is_one_line(faults, tiny, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def full_disk(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    run = tmp_path / "run"
    argv = ["pretrain", "--no-progress", *[a for s in tiny for a in ("--set", s)],
            "--set", f"run_dir={run}"]
    line = faults.expect_error(argv, "cannot save checkpoint step 2 in ", out=run)
    assert "no space left on device (no older checkpoint exists); free disk space" in line


SIGTERM_AT_STEP_3 = """
import os, signal, sys
import lowrank_jax.train.loop as loop

real = loop.batch_at


def batch_at(tokens, step, *args, **kwargs):
    if step == 3:  # a scheduler's SIGTERM arrives mid-run, before step 4
        os.kill(os.getpid(), signal.SIGTERM)
    return real(tokens, step, *args, **kwargs)


loop.batch_at = batch_at
from lowrank_jax.cli import main
sys.argv = ["lowrank-jax", *sys.argv[1:]]
sys.exit(main())
"""


def _cli_process(script, argv):
    import subprocess
    import sys

    command = [sys.executable, *(["-c", script] if script else ["-m", "lowrank_jax.cli"])]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_sigterm_mid_run_saves_and_resumes(faults, tiny, tmp_path):
    run = tmp_path / "run"
    argv = ["pretrain", "--no-progress", *[a for s in tiny for a in ("--set", s)],
            "--set", f"run_dir={run}"]
    proc = _cli_process(SIGTERM_AT_STEP_3, argv)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 143, proc.stderr[-2000:]  # the step under way (4) completes
    assert lines == [f"lowrank-jax pretrain: stopped by SIGTERM at step 4 of 6; checkpoint and "
                     f"summary.json saved in {run} — continue with --resume"], lines[:5]
    assert (run / "checkpoints" / "4" / "lowrank_jax_integrity.json").exists()
    assert json.loads((run / "summary.json").read_text())["stopped"] == "SIGTERM"
    code, out, err = faults.cli([*argv, "--resume"], out=run)
    assert code == 0 and "resumed from step 4" in out, err
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    faults.recovered()


@pytest.mark.slow
def test_sigterm_mid_run_then_resume_is_bit_identical(faults, tiny, tmp_path):
    """Three processes (the numbers of one process are compared with those of another kind
    of process only when both are plain ``lowrank-jax`` runs): interrupted + resumed equals
    uninterrupted, checksum for checksum."""
    sets = [a for s in tiny for a in ("--set", s)]
    run, ref = tmp_path / "run", tmp_path / "ref"
    assert _cli_process(SIGTERM_AT_STEP_3, ["pretrain", "--no-progress", *sets, "--set",
                                            f"run_dir={run}"]).returncode == 143
    resumed = _cli_process(None, ["pretrain", "--no-progress", "--resume", *sets, "--set",
                                  f"run_dir={run}"])
    assert resumed.returncode == 0 and resumed.stderr.strip() == "", resumed.stderr[-2000:]
    assert _cli_process(None, ["pretrain", "--no-progress", *sets, "--set",
                               f"run_dir={ref}"]).returncode == 0
    sums = [json.loads((r / "checkpoints" / "6" / "lowrank_jax_integrity.json").read_text())
            ["checksums"] for r in (run, ref)]
    assert sums[0] == sums[1]
    faults.recovered()
