"""Issue 51, findings 2 and 8: one process per run folder, and run bookkeeping.

- a run folder in use by a live process is refused with one line naming its PID, with or
  without ``--overwrite`` (nothing of the live run is touched); a stale lock (dead PID) is
  taken over with a note (finding 2);
- resuming a finished run is a no-op that says so (no duplicate eval row); a SIGTERM, even
  during a checkpoint save, stops the run at the next step boundary with a checkpoint, a
  summary and exit 143; a run killed before its first checkpoint gets one piece of advice,
  and it works (finding 8).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest

from lowrank_jax.runs.lock import LOCK_NAME


def _sets(overrides):
    return [a for s in overrides for a in ("--set", s)]


@pytest.fixture
def live_process():
    """A process that is running (its PID is what a live run's lock names)."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _lock(run, pid):
    (run / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))


@pytest.mark.parametrize("flags", [["--resume"], ["--overwrite"], []],
                         ids=["--resume", "--overwrite", "plain"])
def test_a_run_in_use_is_refused_naming_its_pid(faults, tiny_runs, tiny, tmp_path,
                                                live_process, flags):
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["split"], run)
    _lock(run, live_process)
    argv = ["pretrain", "--no-progress", *_sets(tiny), "--set", f"run_dir={run}", *flags]
    line = faults.expect_error(argv, f"run_dir {run}: the run is in use by another lowrank-jax "
                                     f"process (PID {live_process}); wait for it to finish")
    assert f"kill {live_process}" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


def test_a_stale_lock_is_taken_over_with_a_note(faults, tiny_runs, tiny, tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its PID names no process
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["split"], run)
    _lock(run, gone.pid)
    code, out, err = faults.cli(["pretrain", "--no-progress", "--resume", *_sets(tiny),
                                 "--set", f"run_dir={run}"], out=run)
    assert code == 0, err
    assert f"run_dir {run}: took over the lock of process {gone.pid}, which is no longer " \
           "running" in out
    assert not (run / LOCK_NAME).exists()  # released when the run ended
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 6
    assert summary["val_loss"] == tiny_runs["full_result"].val_loss
    faults.recovered()


def test_the_lock_is_held_while_training_and_released_after(faults, tiny, tmp_path,
                                                            monkeypatch):
    import lowrank_jax.train.loop as loop
    from lowrank_jax.runs.lock import holder

    seen = []
    real = loop.batch_at

    def batch_at(tokens, step, *args, **kwargs):
        seen.append(holder(tmp_path / "run"))
        return real(tokens, step, *args, **kwargs)

    monkeypatch.setattr(loop, "batch_at", batch_at)
    code, _, err = faults.cli(["pretrain", "--no-progress", *_sets(tiny), "--set",
                               f"run_dir={tmp_path / 'run'}"], out=tmp_path / "run")
    assert code == 0, err
    import os

    assert seen and all(h["pid"] == os.getpid() for h in seen)
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    faults.recovered()


def test_resuming_a_finished_run_is_a_no_op(faults, tiny_runs, tiny, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["full"], run)
    argv = ["pretrain", "--no-progress", "--resume", *_sets(tiny), "--set", f"run_dir={run}"]
    for _ in range(2):  # every time: nothing under tmp_path changes (no second eval row)
        code, out, err = faults.cli(argv)
        assert code == 0, err
        assert f"the run already finished at step 6 ({run / 'summary.json'}); nothing to do" \
            in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [6]
    faults.recovered()


SIGTERM_DURING_THE_SAVE_OF_STEP_2 = """
import os, signal, sys
import lowrank_jax.io.checkpoint as checkpoint

real = checkpoint.checksums
sent = []


def checksums(tree):  # runs inside the save of step 2, while signals are held back
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return real(tree)


checkpoint.checksums = checksums
from lowrank_jax.cli import main
sys.argv = ["lowrank-jax", *sys.argv[1:]]
sys.exit(main())
"""


def test_sigterm_during_a_checkpoint_save_stops_at_the_next_step(faults, tiny_runs, tiny,
                                                                 tmp_path):
    """A process of its own: the SIGTERM watchdog of an in-process command would end the
    test session."""
    import os
    import sys

    run = tmp_path / "run"
    argv = ["pretrain", "--no-progress", *_sets(tiny), "--set", f"run_dir={run}"]
    proc = subprocess.run([sys.executable, "-c", SIGTERM_DURING_THE_SAVE_OF_STEP_2, *argv],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"lowrank-jax pretrain: stopped by SIGTERM at step 2 of 6; checkpoint and "
        f"summary.json saved in {run} — continue with --resume")
    assert json.loads((run / "summary.json").read_text()) == {"step": 2, "stopped": "SIGTERM",
                                                              "steps": 6}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    code, out, err = faults.cli([*argv, "--resume"], out=run)
    assert code == 0 and "resumed from step 2" in out, err
    summary = json.loads((run / "summary.json").read_text())
    # as if never stopped (bit for bit between two plain processes: the slow test of
    # test_checkpoints.py; this in-process reference may differ in the last bits)
    assert summary["val_loss"] == pytest.approx(tiny_runs["full_result"].val_loss, rel=1e-5)
    faults.recovered()


def test_a_run_killed_before_its_first_checkpoint_gets_one_advice_that_works(
        faults, tiny, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # what a kill -9 at step 1 leaves
    (run / ".lowrank-jax.json").write_text('{"command": "pretrain"}\n')
    (run / "config.yaml").write_text("run_dir: run\n")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.5}\n')
    argv = ["pretrain", "--no-progress", *_sets(tiny), "--set", f"run_dir={run}"]
    first = faults.expect_error([*argv, "--resume"], "the run stopped before its first "
                                "checkpoint, so start it again: drop --resume and pass "
                                "--overwrite")
    second = faults.expect_error(argv, "holds a pretrain run that stopped before its first "
                                 "checkpoint")
    assert "pass --overwrite to start it again" in second
    assert "--resume to continue" not in first + second
    code, _, err = faults.cli([*argv, "--overwrite"], out=run)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    faults.recovered()


def test_the_other_processes_of_a_run_share_process_0s_lock(faults, tiny, tmp_path,
                                                            live_process, monkeypatch):
    """A multi-process run holds one lock, process 0's: the others neither take it nor are
    refused by it (here this process plays process 1 while a live process holds the lock)."""
    from lowrank_jax.train import load_config, multihost, train

    run = tmp_path / "run"
    run.mkdir()
    _lock(run, live_process)
    monkeypatch.setattr(multihost, "is_main_process", lambda: False)
    result = train(load_config("tiny", tiny + [f"run_dir={run}"]), progress=False,
                   log=lambda *_: None)
    assert result.state.step == 6
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == live_process  # untouched
    faults.recovered()
