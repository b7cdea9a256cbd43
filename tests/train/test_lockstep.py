"""train.lockstep (lr_shape, set_rates, train_lockstep) and core.step.scan_train, against
hand-written loops."""

import math

import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.core.step import make_step, scan_train
from lowrank_jax.train.lockstep import LockstepRun, lr_shape, train_lockstep


def _loss(w, x, y):
    return jnp.sum((w * x - y) ** 2)


def test_lr_shape_warms_up_linearly_then_decays_to_a_tenth():
    assert [lr_shape(t, 20, 0.2) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(lr_shape(19, 20, 0.2), 0.1 + 0.45 * (1 + math.cos(math.pi * 15 / 16)))
    assert lr_shape(25, 20, 0.2) == 0.1


def test_lockstep_runs_equal_their_own_loops_and_a_diverged_run_stops():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    step = make_step(_loss, tx)
    batch = lambda t: (jnp.float32(1.0 + t), jnp.float32(2.0))  # noqa: E731
    runs = [LockstepRun("a", step, jnp.float32(0.0), tx.init(jnp.float32(0.0)), 4,
                        {"learning_rate": 0.05}, lambda old, new: new - old),
            LockstepRun("b", step, jnp.float32(0.0), tx.init(jnp.float32(0.0)), 2,
                        {"learning_rate": 0.01}),
            LockstepRun("big", step, jnp.float32(0.0), tx.init(jnp.float32(0.0)), 4,
                        {"learning_rate": 10.0})]
    calls = []
    train_lockstep(runs, batch, warmup_frac=0.5, max_loss=100.0, on_step=lambda: calls.append(1))
    assert len(calls) == 4 + 2 + 4
    for run in runs[:2]:  # the same steps written by hand
        w, losses = 0.0, []
        for t in range(run.steps):
            x, y = 1.0 + t, 2.0
            losses.append((w * x - y) ** 2)
            w -= run.rates["learning_rate"] * lr_shape(t, run.steps, 0.5) * 2 * (w * x - y) * x
        np.testing.assert_allclose(run.losses, losses, rtol=1e-5)
        np.testing.assert_allclose(float(run.params), w, rtol=1e-5)
    assert len(runs[0].delta_w) == 4 and runs[1].delta_w == []
    assert len(runs[0].step_times) == 3  # step 0 (compilation) is not timed
    assert runs[2].diverged and len(runs[2].losses) < 4


def test_scan_train_equals_a_loop_of_steps():
    tx = optax.adam(0.1)
    xs, ys = jnp.arange(1.0, 5.0), jnp.full(4, 2.0)
    w, losses = scan_train(_loss, tx, jnp.float32(0.0), (xs, ys))
    step, p, state, want = make_step(_loss, tx), jnp.float32(0.0), tx.init(jnp.float32(0.0)), []
    for x, y in zip(xs, ys):
        p, state, loss = step(p, state, x, y)
        want.append(float(loss))
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    np.testing.assert_allclose(w, p, rtol=1e-5)


def test_train_windows_draws_from_the_callers_stream_and_stops_after_a_non_finite_eval():
    from lowrank_jax.train.loop import train_windows

    windows = np.arange(30, dtype=np.float32).reshape(10, 3)
    seen = []

    def step(w, opt, batch):  # records the rows it was given; "loss" is their mean
        seen.append(np.asarray(batch))
        return w + 1.0, opt, jnp.mean(batch)

    rng = np.random.default_rng(5)
    w, _, losses, curve = train_windows(step, 0.0, None, windows, steps=6, batch_size=2,
                                        rng=rng, evaluate=lambda w: w, eval_every=4)
    want = np.random.default_rng(5)  # the same stream: the same rows, in order
    for batch in seen:
        np.testing.assert_array_equal(batch, windows[want.integers(0, 10, 2)])
    assert rng.integers(0, 10**6) == want.integers(0, 10**6)  # the caller's rng moved on
    assert losses == [float(b.mean()) for b in seen] and len(losses) == 6
    assert curve == [(0, 0.0), (4, 4.0), (6, 6.0)]  # every 4 steps and the last one
    # a diverged run: the evaluation at step 2 is inf, so step 3 never runs
    w, _, losses, curve = train_windows(step, 0.0, None, windows, steps=6, batch_size=2,
                                        rng=np.random.default_rng(0),
                                        evaluate=lambda w: math.inf if w == 2 else w,
                                        eval_every=2)
    assert w == 2.0 and len(losses) == 2 and curve == [(0, 0.0), (2, math.inf)]
