"""Pretraining and LoRA fine-tuning as 2 JAX processes x 4 CPU devices against 1 process x 8.

One launched run covers several checks (process start-up dominates the time); each process runs
``lora_checks.py`` (the LoRA part, then the ``pretrain`` command):

0. LoRA: ``finetune --mesh data=2,fsdp=4`` gives the losses of this process's 8-device run (to
   1e-5); its PEFT adapter and ``--save-merged`` model (gathered from the sharded arrays,
   written once by process 0) equal this process's; one step of BaLoRA, Janus and CrispEdit on
   the sharded model keeps every optimizer state on the sharding rules and gives this
   process's updates;
1. reference: this (8-device) process trains 2 steps and checkpoints; that run is resumed here
   up to step 12;
2. a copy of the step-2 checkpoint is resumed by 2 processes (1 -> 2); their losses equal the
   reference (Spectron on a factorized model, acceptance 1) and metrics.jsonl has each row once;
3. once a later checkpoint is complete, process 1 is frozen (SIGSTOP) and process 0 gets SIGTERM
   while it waits for process 1 in a collective: process 0 gives up within its
   --interrupt-timeout, and the launcher stops process 1 and reports it;
4. the last complete checkpoint of the 2-process run is resumed by this one process (2 -> 1)
   and continues exactly like the reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

import jax
import numpy as np

from safetensors.numpy import load_file

from lowrank_jax.cli import main as cli_main
from lowrank_jax.train import load_config, train
from lowrank_jax.train import sharding as shard_lib
from lowrank_jax.io.checkpoint import checkpoint_manager, restore_checkpoint
from lowrank_jax.train.loop import init_state
from lowrank_jax.train.multihost import launch

WORKER = pathlib.Path(__file__).with_name("lora_checks.py")
_spec = importlib.util.spec_from_file_location("lora_checks", WORKER)
lora_checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_checks)

STEPS = 40  # the schedule length (every run uses the same config; runs stop early)
SETTINGS = [f"train.steps={STEPS}", "train.log_every=1", "train.batch_size=8",
            "train.seq_len=32", "model.n_layers=1", "model.d_model=64", "model.d_ff=128",
            "train.checkpoint_every=2", "train.eval_batches=1", "train.eval_every=1000"]


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    steps = [r["step"] for r in train_rows]
    assert len(steps) == len(set(steps)), f"metrics rows written more than once: {steps}"
    return {r["step"]: r["loss"] for r in train_rows}


def _in_process(run_dir, **kwargs):
    cfg = load_config("tiny", SETTINGS + [f"run_dir={run_dir}", "mesh.data=2", "mesh.fsdp=4"])
    return train(cfg, progress=False, log=lambda *a: None, **kwargs)


def _assert_same_tensors(got_file, want_file, what):
    got, want = load_file(got_file), load_file(want_file)
    assert sorted(got) == sorted(want), what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}: {key}")


def _check_lora(single, multi):
    """The 2-process LoRA outputs (``multi``) against this process's (``single``)."""
    got = json.loads((multi / "lora" / "losses.json").read_text())
    want = json.loads((single / "lora" / "losses.json").read_text())
    assert len(got) == len(want) == 3
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got[-1] != want[0]  # the adapters trained
    adapter = "lora/adapter/adapter_model.safetensors"
    _assert_same_tensors(multi / adapter, single / adapter, "PEFT adapter")
    assert (json.loads((multi / "lora/adapter/adapter_config.json").read_text())
            == json.loads((single / "lora/adapter/adapter_config.json").read_text()))
    _assert_same_tensors(multi / "merged/model.safetensors", single / "merged/model.safetensors",
                         "merged model")
    # written once, by process 0: no temporary folders of a second writer are left behind
    assert sorted(os.listdir(multi / "lora")) == sorted(os.listdir(single / "lora"))
    checks = json.loads((multi / "optimizer_checks.json").read_text())
    # export_peft on the sharded model itself: a clear error that says how to gather
    assert "are sharded over several processes; gather them first" in checks.pop("export_error")
    assert set(checks) == {"balora", "janus", "crispedit"}
    moments = {"balora": 16, "janus": 16, "crispedit": 4}  # Adam's mu, nu of every param
    for name, check in checks.items():
        assert check["problems"] == [], name
        assert check["checked"] == check["init_checked"] == moments[name], name
    updates = np.load(multi / "updates.npz")
    reference = lora_checks.optimizer_checks(shard_lib.make_mesh(2, 4))
    assert reference.pop("export_error") == ""
    for name, result in reference.items():
        for key, value in result["updates"].items():
            np.testing.assert_allclose(updates[f"{name}:{key}"], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: {key}")
    # Janus rectified the protected layer's A update out of the protected subspace
    protected = updates[f"janus:{lora_checks.PROTECTED}/lora_a"]
    assert np.abs(protected[:3]).max() < 1e-6 < np.abs(protected).max()


def test_two_processes_match_one_and_checkpoints_move_between_them(launcher_output, tmp_path):
    reference, shared = tmp_path / "reference", tmp_path / "shared"
    single, multi = tmp_path / "lora_single", tmp_path / "lora_multi"
    multi.mkdir()
    assert cli_main(lora_checks.finetune_argv(str(single))) == 0
    _in_process(reference, stop_after=2)
    shutil.copytree(reference, shared)
    _in_process(reference, resume=True, stop_after=12)
    expected = _losses(reference)

    # -c puts the working directory (the repository) first on sys.path, as -m does
    run_worker = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], " \
        "run_name='__main__')"
    command = [sys.executable, "-c", run_worker, str(WORKER), str(multi), "--",
               "pretrain", "--mesh", "data=2,fsdp=4",
               "--resume", "--no-progress", "--interrupt-timeout", "3",
               "--set", f"run_dir={shared}"]
    for setting in SETTINGS:
        command += ["--set", setting]
    out, procs, timing = launcher_output(), [], {}

    def freeze_then_terminate():
        # wait until a checkpoint after step 2 is complete (process 0 writes its integrity file
        # after every process finished its part), then freeze process 1 and SIGTERM process 0
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and not any(
                (shared / "checkpoints" / str(s) / "lowrank_jax_integrity.json").exists()
                for s in range(4, STEPS, 2)):
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(0.5)
        timing["sigterm"] = time.monotonic()
        os.kill(procs[0].pid, signal.SIGTERM)

    watcher = threading.Thread(target=freeze_then_terminate, daemon=True)
    status, why = launch(command, processes=2, devices_per_process=4, stop_timeout=3.0, out=out,
                         on_start=lambda started: (procs.extend(started), watcher.start()))
    log = out.text()
    assert "sigterm" in timing, f"the run ended (status {status}: {why}) before a checkpoint " \
        f"after step 2 was written:\n{log}"
    stopped_after = time.monotonic() - timing["sigterm"]
    assert status == 143, log
    assert "process 0 of 2 exited with status 143" in why
    assert "[p0] SIGTERM received 3 s ago" in log and "Giving up the interrupt checkpoint" in log
    assert stopped_after < 3 + 3 + 5, f"the launcher took {stopped_after:.1f} s to stop"
    assert all(p.poll() is not None for p in procs)
    _check_lora(single, multi)

    # 1 -> 2: the 2-process continuation of the 1-process checkpoint equals the reference
    two = {step: loss for step, loss in _losses(shared).items() if step > 2}
    assert min(two) == 3 and max(two) >= 4
    for step, loss in two.items():
        np.testing.assert_allclose(loss, expected[step], rtol=1e-5, atol=1e-6,
                                   err_msg=f"step {step}")

    # 2 -> 1: this process resumes the last complete 2-process checkpoint
    last = max(int(p.name) for p in (shared / "checkpoints").iterdir() if p.name.isdigit()
               and (p / "lowrank_jax_integrity.json").exists())
    assert last >= 4
    # restoring the 2-process checkpoint onto this process's 8-device mesh and onto one device
    # gives the same bits
    cfg = load_config("tiny", SETTINGS + [f"run_dir={shared}", "mesh.data=2", "mesh.fsdp=4"])
    mesh = shard_lib.make_mesh(2, 4)
    on_mesh, _ = init_state(cfg, mesh)
    on_mesh, manager = restore_checkpoint(checkpoint_manager(shared), on_mesh, cfg)
    manager.close()
    # Spectron's moments are restored onto their factors' shardings (not replicated)
    checked, problems = lora_checks.rule_violations(on_mesh.opt_state, on_mesh.params, mesh)
    assert problems == [] and checked >= 10, problems
    alone, _ = init_state(cfg, None)
    alone, manager = restore_checkpoint(checkpoint_manager(shared), alone, cfg)
    manager.close()
    assert on_mesh.step == alone.step == last
    for a, b in zip(jax.tree.leaves((on_mesh.params, on_mesh.opt_state)),
                    jax.tree.leaves((alone.params, alone.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    result = _in_process(shared, resume=True, stop_after=last + 2)
    assert result.state.step == last + 2
    resumed = _losses(shared)
    for step in (last + 1, last + 2):  # the 2-process steps before differ in the last bits
        np.testing.assert_allclose(resumed[step], expected[step], rtol=1e-5, atol=1e-6)
