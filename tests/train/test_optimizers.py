"""The CLI is the library: the run config's optimizer is the transform a user builds by hand."""

import jax
import numpy as np
import optax
import pytest

from lowrank_jax.data import batch_at, corpus_bytes
from lowrank_jax.optim import spectron_with_adamw
from lowrank_jax.train import load_config
from lowrank_jax.train.loop import init_state, make_lm_step

SMALL = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=4",
]


@pytest.mark.slow
def test_cli_spectron_config_is_spectron_with_adamw_bit_for_bit(tmp_path):
    steps = 20
    cfg = load_config("tiny", SMALL + [
        f"run_dir={tmp_path}", "optimizer.name=spectron", f"train.steps={steps}",
        "optimizer.weight_decay=0.1", "optimizer.warmup_fraction=0.1",
    ])
    opt = cfg.optimizer
    state, cli_tx = init_state(cfg)
    assert opt.schedule == "cosine" and opt.grad_clip > 0  # the defaults the CLI runs with
    warmup = int(round(opt.warmup_fraction * steps))

    def cosine(peak):  # what a user writes: optax's own schedule, same numbers as the config
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, warmup_steps=warmup, decay_steps=steps, end_value=0.1 * peak)

    user_tx = spectron_with_adamw(
        cosine(opt.learning_rate), cosine(opt.adamw_learning_rate),
        weight_decay=opt.weight_decay, spectron_weight_decay=opt.weight_decay,
        momentum=opt.momentum, clip_norm=opt.grad_clip,
    )
    x, y = batch_at(corpus_bytes(), 0, 4, 32)
    runs = {}
    for name, tx in (("cli", cli_tx), ("user", user_tx)):
        step = make_lm_step(state.graphdef, tx)
        params, opt_state = state.params, jax.jit(tx.init)(state.params)
        losses = []
        for _ in range(4):  # warmup and cosine both exercised (warmup = 2 steps)
            params, opt_state, metrics = step(params, opt_state, x, y)
            losses.append(float(metrics["loss"]))
        runs[name] = (params, losses)
    (p_cli, l_cli), (p_user, l_user) = runs["cli"], runs["user"]
    assert l_cli == l_user
    assert l_cli[-1] < l_cli[0]  # the step is not a no-op
    leaves_cli, leaves_user = jax.tree.leaves(p_cli), jax.tree.leaves(p_user)
    assert len(leaves_cli) == len(leaves_user) > 0
    moved = 0
    for a, b, a0 in zip(leaves_cli, leaves_user, jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        moved += int(not np.array_equal(np.asarray(a), np.asarray(a0)))
    assert moved == len(leaves_cli)

