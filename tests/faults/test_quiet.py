"""Issue 40, finding 1: a recovered fault (newest checkpoint corrupt, every checkpoint corrupt,
a full disk during a save) prints at most a few lines, the clear one last; the libraries'
noise (orbax / absl log records with tracebacks, warnings, ``Exception ignored in`` from
coroutines collected after their event loop closed) goes to the run's ``lowrank-jax.log``,
and every orbax ``CheckpointManager`` is closed when the command returns."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import pytest

NOISE_LINES = 40  # a TensorStore spec / traceback, as orbax logs it before a failure


def _sets(overrides):
    return [a for s in overrides for a in ("--set", s)]


def _noise(tag):
    """What orbax, TensorStore and asyncio print around a failed restore or save."""
    from absl import logging as absl_logging

    spec = "\n".join(f'  "kvstore": {{"path": "params.{i}", "driver": "ocdbt"}},'
                     for i in range(NOISE_LINES))
    absl_logging.error("%s: TensorStore spec of the failed read:\n%s", tag, spec)
    logging.getLogger("orbax").warning("%s: retrying the read", tag)
    warnings.warn(f"{tag}: a library warning", RuntimeWarning, stacklevel=1)

    class ClosedLoopCoroutine:  # an object whose cleanup raises, as a collected coroutine does
        def __del__(self):
            raise RuntimeError(f"{tag}: Event loop is closed")

    ClosedLoopCoroutine()  # collected at once: sys.unraisablehook ("Exception ignored in")


def _flip(step_dir):
    data_file = max((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
                    key=lambda p: (p.stat().st_size, str(p)))
    data = bytearray(data_file.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[i] ^= 0xFF
    data_file.write_bytes(bytes(data))


@pytest.fixture
def noisy_orbax(monkeypatch):
    """orbax's restore and save emit the noise first (the real calls then run)."""
    import orbax.checkpoint as ocp

    real_restore, real_save = ocp.CheckpointManager.restore, ocp.CheckpointManager.save

    def restore(self, step, *args, **kwargs):
        _noise(f"restore {step}")
        return real_restore(self, step, *args, **kwargs)

    def save(self, step, *args, **kwargs):
        _noise(f"save {step}")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
    monkeypatch.setattr(ocp.CheckpointManager, "save", save)


def _log(run):
    return (run / "lowrank-jax.log").read_text()


def _no_open_managers():
    from lowrank_jax.io import checkpoint

    return len(checkpoint._OPEN) == 0


def test_newest_checkpoint_corrupt_recovers_in_few_lines(faults, tiny_runs, tiny, tmp_path,
                                                         noisy_orbax):
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["split"], run)
    _flip(run / "checkpoints" / "4")
    code, out, err = faults.cli(["pretrain", "--no-progress", "--resume",
                                 *_sets(tiny + [f"run_dir={run}"])], out=run)
    assert code == 0, err
    # the checksums or TensorStore catch the flipped bytes (it depends on where they land)
    assert "step 4 is corrupt (" in out and "resuming from step 2" in out
    assert err.strip() == ""  # the noise: in the run's log, not on the terminal
    log = _log(run)
    assert "restore 4: TensorStore spec" in log and "params.39" in log
    assert "restore 4: Event loop is closed" in log and "restore 4: a library warning" in log
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    assert _no_open_managers()
    faults.recovered()


def test_every_checkpoint_corrupt_is_one_line_last(faults, tiny_runs, tiny, tmp_path,
                                                   noisy_orbax):
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["split"], run)
    for step in ("2", "4"):
        _flip(run / "checkpoints" / step)
    line = faults.expect_error(["pretrain", "--no-progress", "--resume",
                                *_sets(tiny + [f"run_dir={run}"])],
                               "every checkpoint in", out=run)
    assert line.startswith("lowrank-jax pretrain: error: --resume: every checkpoint in")
    assert "restore 2: TensorStore spec" in _log(run)
    assert _no_open_managers()


def test_full_disk_during_a_save_is_one_line_last(faults, tiny, tmp_path, monkeypatch,
                                                  noisy_orbax):
    import orbax.checkpoint as ocp

    noisy_save = ocp.CheckpointManager.save

    def full_disk_at_4(self, step, *args, **kwargs):
        if int(step) == 4:
            _noise("save 4")
            raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))
        return noisy_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk_at_4)
    run = tmp_path / "run"
    line = faults.expect_error(["pretrain", "--no-progress",
                                *_sets(tiny + [f"run_dir={run}"])],
                               "cannot save checkpoint step 4 in ", out=run)
    assert "no space left on device (step 2 is intact; continue with --resume)" in line
    assert "save 4: TensorStore spec" in _log(run)
    assert _no_open_managers()
    # with the disk freed, --resume continues from step 2
    monkeypatch.setattr(ocp.CheckpointManager, "save", noisy_save)
    code, out, err = faults.cli(["pretrain", "--no-progress", "--resume",
                                 *_sets(tiny + [f"run_dir={run}"])], out=run)
    assert code == 0 and "resumed from step 2" in out, err
    faults.recovered()


SHUTDOWN = """
import atexit
import sys
from lowrank_jax.io import checkpoint


def closed_loop():  # like an orbax finalizer that finds its event loop closed at exit
    raise RuntimeError("Event loop is closed")


real = checkpoint.restore_checkpoint


def restore(*args, **kwargs):
    atexit.register(closed_loop)
    return real(*args, **kwargs)


checkpoint.restore_checkpoint = restore
import lowrank_jax.train.loop as loop
loop.restore_checkpoint = restore
from lowrank_jax.cli import main
sys.argv = ["lowrank-jax", *sys.argv[1:]]
sys.exit(main())
"""


def test_the_program_stays_quiet_through_shutdown(faults, tiny_runs, tiny, tmp_path):
    """As a program (not in-process): ``Exception ignored in`` at interpreter exit goes to the
    run's log too."""
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["split"], run)
    _flip(run / "checkpoints" / "4")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHUTDOWN, "pretrain", "--no-progress",
                           "--resume", *_sets(tiny + [f"run_dir={run}"])],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 4 is corrupt" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr[-2000:]
    assert "Event loop is closed" in _log(run)
    faults.recovered()


@pytest.mark.parametrize("damaged", [("4",), ("2", "4")], ids=["newest step", "every step"])
def test_a_lost_data_folder_is_quiet_as_a_program(faults, tiny_runs, tiny, tmp_path, damaged):
    """The noise as users met it (no injection): a step whose ``default/d`` data folder is
    gone makes orbax's TensorStore callbacks hit a closed event loop (on main: 192 stderr
    lines for the recovery, 265 before the clear line when every step is gone)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_runs["split"], run)
    for step in damaged:
        shutil.rmtree(run / "checkpoints" / step / "default" / "d")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "lowrank_jax.cli", "pretrain", "--no-progress",
                           "--resume", *_sets(tiny + [f"run_dir={run}"])],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if len(damaged) == 1:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "step 4 is corrupt" in proc.stdout and "resuming from step 2" in proc.stdout
        assert lines == [], lines[:5]
        faults.recovered()
    else:
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert len(lines) == 1, lines[:5]
        assert lines[0].startswith("lowrank-jax pretrain: error: --resume: every checkpoint in")
        faults.clear_error()
