"""The training loop: loss goes down, resume is bit-identical, bad input stops early."""


import json
import math

import jax
import numpy as np
import pytest

from lowrank_jax.cli import main as cli_main
from lowrank_jax.train import load_config, train
from lowrank_jax.train.loop import init_state, make_lm_step
from lowrank_jax.data import batch_at, corpus_bytes

SMALL = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=8",
    "train.eval_batches=2", "train.eval_every=4", "train.checkpoint_every=4",
    "train.log_every=2",
]


def small_config(tmp_path, *extra):
    return load_config("tiny", SMALL + [f"run_dir={tmp_path}"] + list(extra))


@pytest.mark.parametrize("optimizer", ["adamw", "spectron"])
def test_train_step_lowers_loss_on_fixed_batch(tmp_path, optimizer):
    lr = "0.05" if optimizer == "spectron" else "0.01"
    cfg = small_config(tmp_path, f"optimizer.name={optimizer}", f"optimizer.learning_rate={lr}",
                       "optimizer.warmup_fraction=0.0", "optimizer.schedule=constant",
                       "train.steps=100")
    state, tx = init_state(cfg)
    step = make_lm_step(state.graphdef, tx)
    x, y = batch_at(corpus_bytes(), 0, 8, 32)
    params, opt_state = state.params, state.opt_state
    losses = []
    for _ in range(15):
        params, opt_state, m = step(params, opt_state, x, y)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("spectron", marks=pytest.mark.slow)])
def test_resume_is_bit_identical(tmp_path, optimizer):
    full = train(small_config(tmp_path / "full", "train.steps=8", f"optimizer.name={optimizer}"),
                 progress=False, log=lambda *_: None)
    cfg = small_config(tmp_path / "split", "train.steps=8", f"optimizer.name={optimizer}")
    first = train(cfg, stop_after=4, progress=False, log=lambda *_: None)
    assert first.state.step == 4
    resumed = train(cfg, resume=True, progress=False, log=lambda *_: None)
    assert resumed.state.step == 8
    a = jax.tree.leaves(full.state.params)
    b = jax.tree.leaves(resumed.state.params)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert full.val_loss == resumed.val_loss


def test_run_writes_metrics_plot_and_beats_unigram(tmp_path, saved_figures):
    cfg = small_config(tmp_path, "train.steps=60", "optimizer.name=adamw",
                       "optimizer.learning_rate=0.01")
    result = train(cfg, progress=False, log=lambda *_: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    eval_rows = [(r["step"], r["val_loss"]) for r in rows if r["kind"] == "eval"]
    assert [s for s, _ in train_rows] == list(range(2, 61, 2))  # train.log_every=2
    assert [s for s, _ in eval_rows][:2] == [4, 8] and eval_rows[-1][0] == 60  # eval_every=4
    # loss.png draws those rows and the unigram entropy (in nats) as the reference line
    plot = saved_figures[str(tmp_path / "loss.png")]
    (_, train_x, train_y), (_, eval_x, eval_y), (_, _, unigram) = plot.lines()
    assert list(zip(train_x, train_y)) == pytest.approx(train_rows)
    assert list(zip(eval_x, eval_y)) == pytest.approx(eval_rows)
    assert unigram[0] == pytest.approx(result.unigram_entropy_bits * math.log(2))
    assert plot.ink() > 0.02
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 60 and summary["val_loss"] == pytest.approx(result.val_loss)
    assert summary["val_bits_per_byte"] == pytest.approx(result.val_bits_per_byte)
    assert eval_rows[-1][1] == pytest.approx(result.val_loss)  # the last evaluation
    assert load_config(str(tmp_path / "config.yaml")).to_dict() == cfg.to_dict()
    assert result.val_bits_per_byte < 8.0 - 2.0  # far below a uniform byte model (8 bits)
    assert np.mean(result.losses[-10:]) < result.losses[0] - 1.5  # it learned


def test_cli_bad_inputs_fail_fast(tmp_path, capsys):
    cases = [
        (["--set", "optimizer.nme=adamw"], "Did you mean 'name'"),
        (["--set", "optimizer.learning_rate=-1"], "optimizer.learning_rate=-1 must be a positive"),
        (["--set", "model.rank_ratio=1.5"], "rank_ratio=1.5"),
        (["--set", f"run_dir={tmp_path / 'none'}", "--resume"], "no checkpoint"),
        (["--set", "colour=red"], "Unknown config key 'colour'"),
        (["--set", f"run_dir={tmp_path / 'mesh'}", "--mesh", "data=3"], "needs 3 devices"),
    ]
    for argv, expected in cases:
        code = cli_main(["pretrain", "--no-progress", *argv])
        err = capsys.readouterr().err
        assert code == 2 and expected in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
