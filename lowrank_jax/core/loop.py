"""The package's one training loop: steps of a :func:`~lowrank_jax.core.step.make_step` step, one
rule for non-finite losses, one progress bar, one evaluation hook.

Every trainer runs its steps here (:func:`run_steps`, or :func:`iterate_steps` when the caller
does its own bookkeeping between steps: checkpoints, metrics files, runs in lockstep); what is
special about a trainer is its step (built by ``make_step``), its batches and its hooks.

The non-finite rule (``nonfinite=``), the same in every trainer:

* ``"raise"`` (the default): a non-finite loss stops the run with one
  ``FloatingPointError`` (:class:`NonFiniteLoss`) ``"<what>: loss became nan at step <t>;
  <hint>"``; it carries the step, the loss and the last state (the one before the step when the
  step was built with ``skip_nonfinite=True``, which never applies such an update).
* ``"skip"``: the update of a non-finite step is not applied (the step's own
  ``skip_nonfinite=True`` does it, or the loop keeps the previous state; a donating step must
  skip by itself) and the step index joins ``skipped``; the run goes on. This is what Spectron's
  in-transform skip (:func:`lowrank_jax.optim.spectron`) does for its updates.
* ``"stop"``: the run ends there, as a result (``stopped == "nonfinite"``), not an error: a
  diverged run of a sweep.

A loss above ``diverge_above`` counts as non-finite; a non-finite evaluation stops the run
(``"stop"``, ``"skip"``) or raises (``"raise"``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

NONFINITE = ("raise", "skip", "stop")


class NonFiniteLoss(FloatingPointError):
    """A non-finite loss (or evaluation) under ``nonfinite="raise"``; ``step``, ``loss`` and the
    last ``params`` / ``opt_state`` are attributes."""

    def __init__(self, message: str, *, step: int, loss: float, params=None, opt_state=None):
        super().__init__(message)
        self.step, self.loss, self.params, self.opt_state = step, loss, params, opt_state


def progress_bar(total: int, desc: str | None, *, initial: int = 0):
    """The package's training progress bar (tqdm): ``total`` steps titled ``desc``, hidden when
    ``desc`` is ``None`` (pass ``None`` on every process but the first)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=desc is None, leave=False,
                dynamic_ncols=True)


@dataclasses.dataclass
class LoopState:
    """The state of a run after ``step`` steps (what :func:`iterate_steps` yields and
    :func:`run_steps` returns).

    ``value`` is what the last step returned, ``loss`` its loss as a float (the mean of a
    vector of losses: per worker, per job); ``losses`` every step's; ``curve`` the
    ``(step, evaluate(params))`` pairs; ``skipped`` the steps whose update was not applied;
    ``stopped`` is ``None``, ``"nonfinite"`` (``nonfinite="stop"``) or ``"hook"`` (``on_step``
    asked); ``postfix`` holds extra fields for the progress bar (the caller may add some).
    """

    params: Any
    opt_state: Any
    step: int = 0
    value: Any = None
    loss: float | None = None
    losses: list = dataclasses.field(default_factory=list)
    curve: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    stopped: str | None = None
    postfix: dict = dataclasses.field(default_factory=dict)


def _loss_of(value) -> tuple[np.ndarray, bool | None]:
    """``(loss, finite)`` of a step's value: a loss, ``(loss, aux)`` or the metrics dict of
    ``make_step(skip_nonfinite=True)`` (whose ``finite`` says whether the update was applied)."""
    if isinstance(value, dict):
        return np.asarray(value["loss"]), bool(value["finite"]) if "finite" in value else None
    if isinstance(value, tuple):
        value = value[0]
    return np.asarray(value), None


def iterate_steps(step: Callable, params, opt_state, batches: Callable[[int], tuple], *,
                  steps: int, start: int = 0, nonfinite: str = "raise",
                  what: str = "training", hint: str = "lower the learning rate.",
                  diverge_above: float | None = None, progress: str | None = None,
                  evaluate: Callable | None = None, eval_every: int = 0,
                  eval_first: bool = False) -> Iterator[LoopState]:
    """Run ``step`` for ``t = start .. steps - 1``, yielding the :class:`LoopState` after each.

    Args:
        step: ``step(params, opt_state, *batches(t)) -> (params, opt_state, value)``, e.g. a
            :func:`~lowrank_jax.core.step.make_step` step (``value``: a loss, ``(loss, aux)``,
            or the metrics dict of ``skip_nonfinite=True``).
        params, opt_state: the state to start from.
        batches: ``t -> tuple`` of the step's arguments after the state (a batch, frozen
            weights, keys).
        steps: the step count the run ends at; ``start``: the steps already done (a resumed run).
        nonfinite: ``"raise"``, ``"skip"`` or ``"stop"`` (see the module's rule).
        what, hint: the error's subject and its advice, ``"<what>: loss became nan at step
            <t>; <hint>"``.
        diverge_above: a loss above it counts as non-finite (a diverged run).
        progress: the progress bar's title (``None``: no bar).
        evaluate: ``evaluate(params) -> value`` (a float or anything else) every
            ``eval_every`` steps and after the last (``eval_every=0``: after the last only),
            and before the first with ``eval_first``; the pairs ``(step, value)`` form
            ``curve``.

    The yielded object is the same one each time, updated in place; changing its ``params`` or
    ``opt_state`` between steps changes what the next step starts from.
    """
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite={nonfinite!r} is unknown; use one of {', '.join(NONFINITE)}.")
    state = LoopState(params, opt_state, start)
    bar = progress_bar(steps, progress, initial=start)

    def check(value, t, kind):
        if nonfinite == "raise":
            raise NonFiniteLoss(f"{what}: {kind} became {value} at step {t}; {hint}", step=t,
                                loss=value, params=state.params, opt_state=state.opt_state)
        state.stopped = "nonfinite"

    def evaluation(t):
        value = evaluate(state.params)
        state.curve.append((t, value))
        if isinstance(value, (float, int, np.floating)) and not math.isfinite(value):
            check(float(value), t, "evaluation")

    try:
        if evaluate is not None and eval_first:
            evaluation(start)
        for t in range(start, steps):
            if state.stopped:
                break
            new_params, new_opt_state, value = step(state.params, state.opt_state, *batches(t))
            loss, finite = _loss_of(value)
            ok = bool(np.all(np.isfinite(loss))) and (
                diverge_above is None or not np.any(loss > diverge_above))
            state.value, state.loss = value, float(np.mean(loss))
            state.losses.append(state.loss)
            if not ok or finite is False:
                if nonfinite != "skip":
                    if finite is not False:  # the update was applied: the run ends on it
                        state.params, state.opt_state = new_params, new_opt_state
                    state.step = t + 1
                    check(state.loss, t, "loss")
                    if evaluate is not None:
                        evaluation(t + 1)
                    yield state
                    break
                state.skipped.append(t)
                if finite is None:  # keep the state from before the step
                    new_params, new_opt_state = state.params, state.opt_state
            state.params, state.opt_state, state.step = new_params, new_opt_state, t + 1
            if evaluate is not None and (state.step == steps
                                         or eval_every and state.step % eval_every == 0):
                evaluation(state.step)
            yield state
            bar.update(1)  # after the caller's bookkeeping, with the fields it added
            bar.set_postfix(loss=f"{state.loss:.4f}", **state.postfix, refresh=False)
    finally:
        bar.close()


def run_steps(step: Callable, params, opt_state, batches: Callable[[int], tuple], *,
              steps: int, on_step: Callable[[LoopState], Any] | None = None,
              **options) -> LoopState:
    """The whole run of :func:`iterate_steps` (same arguments); ``on_step(state)`` after each
    step (a true return value ends the run, ``stopped == "hook"``). Returns the last
    :class:`LoopState`.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> from lowrank_jax.core.step import make_step
        >>> tx = optax.sgd(0.5)
        >>> step = make_step(lambda w, x: jnp.sum((w - x) ** 2), tx)
        >>> run = run_steps(step, jnp.zeros(1), tx.init(jnp.zeros(1)), lambda t: (jnp.ones(1),),
        ...                 steps=3, evaluate=lambda w: float(w[0]), eval_first=True)
        >>> run.losses, run.curve
        ([1.0, 0.0, 0.0], [(0, 0.0), (3, 1.0)])
        >>> bad = run_steps(step, jnp.zeros(1), tx.init(jnp.zeros(1)),
        ...                 lambda t: (jnp.full(1, jnp.nan if t == 1 else 1.0),), steps=3,
        ...                 nonfinite="stop")
        >>> bad.step, bad.stopped
        (2, 'nonfinite')
    """
    state = LoopState(params, opt_state, options.get("start", 0))
    for state in iterate_steps(step, params, opt_state, batches, steps=steps, **options):
        if on_step is not None and on_step(state) and not state.stopped:
            state.stopped = "hook"
            break
    return state


__all__ = ["LoopState", "NONFINITE", "NonFiniteLoss", "iterate_steps", "progress_bar",
           "run_steps"]
