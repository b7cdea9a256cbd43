"""The one training loop's non-finite rule, the same for every trainer (issue 52)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax.core import NonFiniteLoss, make_step, run_steps

TX = optax.sgd(0.5)


def _loss(w, x):
    return jnp.sum((w - x) ** 2)


def _batches(bad):
    """``x = 1``, except NaN at the steps in ``bad``."""
    return lambda t: (jnp.full(1, jnp.nan if t in bad else 1.0),)


def test_a_non_finite_loss_raises_naming_the_step_and_the_fix():
    with pytest.raises(NonFiniteLoss, match=r"^toy: loss became nan at step 1; lower the lr\.$") \
            as info:
        run_steps(make_step(_loss, TX), jnp.zeros(1), TX.init(jnp.zeros(1)), _batches({1}),
                  steps=4, what="toy", hint="lower the lr.")
    assert info.value.step == 1 and isinstance(info.value, FloatingPointError)


@pytest.mark.parametrize("in_step", [False, True])
def test_skip_keeps_the_state_and_reports_the_step_alike(in_step):
    # the loop keeps the old state itself, or the step does (make_step(skip_nonfinite=True))
    step = make_step(_loss, TX, skip_nonfinite=in_step)
    run = run_steps(step, jnp.zeros(1), TX.init(jnp.zeros(1)), _batches({1, 2}), steps=4,
                    nonfinite="skip")
    clean = run_steps(step, jnp.zeros(1), TX.init(jnp.zeros(1)), _batches(set()), steps=2)
    assert run.skipped == [1, 2] and run.step == 4 and run.stopped is None
    np.testing.assert_array_equal(run.params, clean.params)  # two applied steps, the same ones
    assert np.isnan(run.losses[1]) and run.losses[0] == 1.0


def test_stop_ends_the_run_as_a_result_with_a_last_evaluation():
    run = run_steps(make_step(_loss, TX), jnp.zeros(1), TX.init(jnp.zeros(1)), _batches({2}),
                    steps=5, nonfinite="stop", evaluate=lambda w: float(w[0]), eval_every=1)
    assert run.stopped == "nonfinite" and run.step == 3 and len(run.losses) == 3
    assert [t for t, _ in run.curve] == [1, 2, 3] and np.isnan(run.curve[-1][1])


def test_diverge_above_and_the_hook_stop_the_run():
    loss = lambda w, x: jnp.sum(w * 0 + x)  # noqa: E731
    big = run_steps(make_step(loss, TX), jnp.zeros(1), TX.init(jnp.zeros(1)),
                    lambda t: (jnp.full(1, float(t)),), steps=9, nonfinite="stop",
                    diverge_above=2.5)
    assert big.stopped == "nonfinite" and big.losses == [0.0, 1.0, 2.0, 3.0]
    hooked = run_steps(make_step(loss, TX), jnp.zeros(1), TX.init(jnp.zeros(1)),
                       lambda t: (jnp.ones(1),), steps=9, on_step=lambda run: run.step == 2)
    assert hooked.stopped == "hook" and hooked.step == 2
    with pytest.raises(ValueError, match="nonfinite='ignore' is unknown"):
        run_steps(make_step(loss, TX), jnp.zeros(1), TX.init(jnp.zeros(1)),
                  lambda t: (jnp.ones(1),), steps=1, nonfinite="ignore")
