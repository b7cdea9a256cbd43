"""Several training runs advanced one step each in turn, with a scheduled learning rate.

Runs in lockstep see the same batch at the same step, and a swing of machine load hits every run
alike, so their step times compare within one process (a ratio of medians). Each run's rates are
``optax.inject_hyperparams`` hyperparameters set before every step to ``peak · lr_shape(step)``
(:func:`lr_shape`: linear warm-up, then cosine decay to 10%).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowrank_jax.core.loop import iterate_steps


def lr_shape(step: int, total: int, warmup_frac: float) -> float:
    """Linear warmup over ``warmup_frac`` of the steps, then cosine decay to 10%.

    Unlike :func:`lowrank_jax.train.optimizers.schedule` (which starts at 0), step 0 already
    takes ``1 / warmup`` of the peak.

    Example::

        >>> [round(lr_shape(t, 10, 0.2), 3) for t in (0, 1, 2, 9)]
        [0.5, 1.0, 1.0, 0.134]
    """
    warmup = max(1, int(round(warmup_frac * total)))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def set_rates(opt_state, shape: float, rates: dict[str, float]) -> None:
    """Set each ``inject_hyperparams`` hyperparameter ``name`` of ``opt_state`` to
    ``rates[name] · shape`` (float32), in place.

    Example::

        >>> import optax
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
        >>> state = tx.init(jnp.zeros(2))
        >>> set_rates(state, 0.5, {"learning_rate": 0.1})
        >>> float(state.hyperparams["learning_rate"])
        0.05000000074505806
    """
    for name, peak in rates.items():
        opt_state.hyperparams[name] = jnp.asarray(peak * shape, jnp.float32)


@dataclasses.dataclass
class LockstepRun:
    """One run of :func:`train_lockstep` and what it recorded.

    ``step(params, opt_state, inputs, targets) -> (params, opt_state, loss)`` (e.g.
    :func:`lowrank_jax.core.step.make_step`); ``rates``: ``{hyperparameter: peak}``;
    ``delta(old, new)``: a scalar of each update (e.g.
    :func:`lowrank_jax.optim.max_update_norm`), logged outside the timed region; ``tags``: the
    caller's labels. ``step_times`` leaves out step 0 (compilation).
    """

    name: str
    step: Callable
    params: Any
    opt_state: Any
    steps: int
    rates: dict[str, float]
    delta: Callable | None = None
    tags: dict = dataclasses.field(default_factory=dict)
    losses: list = dataclasses.field(default_factory=list)
    delta_w: list = dataclasses.field(default_factory=list)
    step_times: list = dataclasses.field(default_factory=list)
    diverged: bool = False


def train_lockstep(runs: list[LockstepRun], batch: Callable, *, warmup_frac: float,
                   max_loss: float = 20.0, on_step: Callable | None = None) -> None:
    """Advance every run step by step, one step of each run in turn, on ``batch(step)``.

    A run takes ``run.steps`` steps at rates ``run.rates`` times :func:`lr_shape` of its own
    length; it stops (``diverged``) at a non-finite loss or one above ``max_loss``.
    ``on_step()`` is called once per run and step (a progress bar), diverged runs included.

    Example::

        >>> import optax
        >>> from lowrank_jax.core.step import make_step
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> step = make_step(lambda w, x, y: jnp.sum((w - x) ** 2), tx)
        >>> run = LockstepRun("sgd", step, jnp.zeros(1), tx.init(jnp.zeros(1)), 3,
        ...                   {"learning_rate": 0.1})
        >>> train_lockstep([run], lambda t: (jnp.ones(1), jnp.ones(1)), warmup_frac=0.0)
        >>> len(run.losses), run.losses[0]
        (3, 1.0)
    """
    batches = functools.lru_cache(maxsize=1)(batch)  # one batch per step, shared by the runs
    # each run's steps on the one loop, advanced one at a time; a diverged run stops there
    live = {id(run): iterate_steps(run.step, run.params, run.opt_state, batches,
                                   steps=run.steps, nonfinite="stop", diverge_above=max_loss,
                                   what=run.name) for run in runs}
    for t in range(max(run.steps for run in runs)):
        batches(t)  # drawn before the timed steps
        for run in runs:
            if t >= run.steps:
                continue
            if not run.diverged:
                set_rates(run.opt_state, lr_shape(t, run.steps, warmup_frac), run.rates)
                old = run.params
                start = time.perf_counter()
                state = next(live[id(run)])
                jax.block_until_ready(state.params)
                if t > 0:  # step 0 includes compilation
                    run.step_times.append(time.perf_counter() - start)
                run.params, run.opt_state = state.params, state.opt_state
                run.losses.append(state.loss)
                if run.delta is not None:
                    run.delta_w.append(float(run.delta(old, state.params)))
                run.diverged = state.stopped is not None
            if on_step is not None:
                on_step()


__all__ = ["LockstepRun", "lr_shape", "set_rates", "train_lockstep"]
