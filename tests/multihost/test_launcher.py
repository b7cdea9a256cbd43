"""The local multi-process launcher, the shared-run_dir check and per-process batch shards."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lowrank_jax.cli import main as cli_main
from lowrank_jax.data import batch_at, corpus_bytes
from lowrank_jax.train import sharding as shard_lib
from lowrank_jax.train.multihost import launch, process_env, sharded_batch


def test_one_process_killed_stops_all_within_seconds(launcher_output):
    script = ("import os, signal, time\n"
              "print('hello from', os.environ['JAX_PROCESS_ID'], flush=True)\n"
              "if os.environ['JAX_PROCESS_ID'] == '1':\n"
              "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(120)\n")
    out, procs = launcher_output(), []
    start = time.monotonic()
    status, why = launch([sys.executable, "-c", script], processes=2, devices_per_process=1,
                         stop_timeout=2.0, out=out, on_start=procs.extend)
    elapsed = time.monotonic() - start
    assert status == 128 + 9
    assert why.startswith("process 1 of 2 killed by SIGKILL; the other processes were stopped")
    assert "--resume" in why
    assert elapsed < 8, f"took {elapsed:.1f} s"
    assert all(p.poll() is not None for p in procs)
    assert sorted(line.strip() for line in out.lines) == ["[p0] hello from 0",
                                                         "[p1] hello from 1"]


def test_all_succeed_and_environment(launcher_output):
    status, why = launch([sys.executable, "-c", "print('ok')"], processes=3,
                         devices_per_process=2, out=launcher_output())
    assert (status, why) == (0, "")
    env = process_env(1, 2, 4, 1234, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"
                                           " --xla_dump_to=x"})
    assert env["JAX_COORDINATOR_ADDRESS"] == "localhost:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("2", "1")
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=x",
                                        "--xla_force_host_platform_device_count=4"]
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"


@pytest.mark.no_typecheck
def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(ValueError, match="processes=0 must be a positive integer"):
        launch(["true"], processes=0, devices_per_process=1)
    assert cli_main(["launch", "--processes", "2"]) == 2
    finetune = ["finetune", "--model", "tiny", "--mesh", "data=2,fsdp=4", "--steps", "1",
                "--out", str(tmp_path / "ft")]
    assert cli_main(finetune + ["--batch-size", "6"]) == 2
    assert ("batch size 6 is not divisible by the mesh's data x fsdp = 8; use a multiple of 8"
            in capsys.readouterr().err)
    assert cli_main(finetune + ["--mesh", "data=3"]) == 2
    assert "needs 3 devices, but 8 are available" in capsys.readouterr().err
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("jobs: []\n")
    assert cli_main(finetune + ["--jobs", str(jobs)]) == 2
    assert "--jobs trains packed jobs on one device; drop --mesh" in capsys.readouterr().err


def test_each_process_builds_its_rows_of_the_same_batch():
    tokens = corpus_bytes()
    x, y = batch_at(tokens, 7, 8, 16, 3)
    part = batch_at(tokens, 7, 8, 16, 3, rows=slice(2, 6))
    np.testing.assert_array_equal(part[0], x[2:6])
    np.testing.assert_array_equal(part[1], y[2:6])
    spec = shard_lib.batch_sharding(shard_lib.make_mesh(2, 4))
    gx, gy = sharded_batch(tokens, 7, 8, 16, 3, spec)
    assert gx.sharding == spec
    np.testing.assert_array_equal(np.asarray(gx), x)
    np.testing.assert_array_equal(np.asarray(gy), y)
    assert len(jax.devices()) == 8


def test_run_dir_per_process_is_one_clear_error(launcher_output, tmp_path, monkeypatch):
    # what a user without a shared filesystem does: each host its own run_dir (the launched
    # processes wait 1 s for the other's file, not the default 10 s)
    monkeypatch.setenv("LOWRANK_JAX_SHARED_FOLDER_TIMEOUT", "1")
    command = ["sh", "-c", f'exec "{sys.executable}" -m lowrank_jax.cli pretrain --mesh '
               f'data=2,fsdp=4 --no-progress --set run_dir="{tmp_path}/p$JAX_PROCESS_ID" '
               "--set train.steps=2"]
    out = launcher_output()
    start = time.monotonic()
    status, why = launch(command, processes=2, devices_per_process=4, out=out)
    text = out.text()
    assert status == 2, text
    assert time.monotonic() - start < 120
    assert "error: run_dir" in text and "is not shared by all 2 processes" in text
    assert "process(es) 1 cannot see the file process 0 wrote" in text and "(waited 1 s)" in text
    assert not (tmp_path / "p0" / "checkpoints").exists()


def test_sigterm_while_stuck_ends_within_the_timeout():
    # the main thread never returns to Python after SIGTERM (like an interrupt checkpoint
    # waiting in a barrier for a process that is gone): the watchdog ends the process
    script = ("import signal, sys, threading\n"
              "from lowrank_jax.train.multihost import install_interrupt_watchdog\n"
              "def stop(signum, frame): raise KeyboardInterrupt\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "install_interrupt_watchdog(1.0)\n"
              "try:\n"
              "    print('ready', flush=True)\n"
              "    threading.Event().wait(120)\n"
              "except KeyboardInterrupt:\n"
              "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "    threading.Event().wait(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert time.monotonic() - start < 10
    assert "SIGTERM received 1 s ago" in err and "continue with --resume" in err
