"""Reading a sweep of training runs: best run per arm, steps to a target, smoothed curves,
value grids, the best cell of a grid and how many cells come close to it (host-side NumPy).

A run is a ``dict`` (as a reproduction stores it in JSON), e.g. ``{"method": "lora",
"lr": 1e-3, "curve": [(step, held-out loss), ...], "final": 2.1}``; an arm's runs differ by
one setting (the learning rate) and the arm is reported at its best run. A 2-D sweep (learning
rate × scale) scores each cell, usually by the last value of the run's loss curve smoothed by an
exponential moving average

.. math::
   \\bar\\ell_0 = \\ell_0, \\qquad
   \\bar\\ell_t = \\beta\\,\\bar\\ell_{t-1} + (1-\\beta)\\,\\ell_t ;

a method is *robust* to the grid when many cells end within a tolerance of its best one
(:func:`count_within`), and *fast* when its curve reaches a target loss in few steps
(:func:`steps_to_target`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def best_runs(runs: Iterable[dict], *, arm: str = "method", score: str = "final") -> dict:
    """``{arm: run}`` with the lowest finite ``run[score]`` of each arm (the first on ties).

    Runs whose score is NaN or infinite (diverged) are never chosen; an arm with only such runs
    is left out.

    Example::

        >>> runs = [{"method": "a", "lr": 1, "final": 2.0}, {"method": "a", "lr": 2, "final": 1.5},
        ...         {"method": "b", "lr": 1, "final": float("nan")}]
        >>> {k: v["lr"] for k, v in best_runs(runs).items()}
        {'a': 2}
    """
    best: dict = {}
    for run in runs:
        value = run[score]
        if math.isfinite(value) and (run[arm] not in best or value < best[run[arm]][score]):
            best[run[arm]] = run
    return best


def progress_target(start: float, best: float, fraction: float = 0.8) -> float:
    """The loss ``fraction`` of the way from ``start`` down to ``best``.

    Example::

        >>> progress_target(3.0, 2.0)
        2.2
    """
    return start - fraction * (start - best)


def steps_to_target(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first step of ``curve`` (``[(step, loss), ...]``) whose loss is ``<= target``, else
    ``None``.

    Example::

        >>> steps_to_target([(0, 3.0), (5, 2.5), (10, 2.1)], 2.2), steps_to_target([(0, 3.0)], 1)
        (10, None)
    """
    for step, loss in curve:
        if loss <= target:
            return step
    return None


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Means of every ``window`` consecutive values (``len(values) - window + 1`` of them).

    Example::

        >>> moving_average([1.0, 2.0, 3.0, 4.0], 2).tolist()
        [1.5, 2.5, 3.5]
    """
    return np.convolve(np.asarray(values, np.float64), np.ones(window) / window, mode="valid")


def parse_grid(text: str) -> list[float]:
    """The values of a grid written ``"1e-3,1e-2"`` or ``"logspace:LOW:HIGH:COUNT"``.

    ``logspace:A:B:N`` is ``N`` values from ``10**A`` to ``10**B`` (both included).

    Raises:
        ValueError: when a ``logspace:`` grid does not have three numeric fields.

    Example::

        >>> parse_grid("1e-3,0.5")
        [0.001, 0.5]
        >>> [round(v, 6) for v in parse_grid("logspace:-2:0:3")]
        [0.01, 0.1, 1.0]
    """
    if text.startswith("logspace:"):
        try:
            _, low, high, count = text.split(":")
            return [float(v) for v in np.logspace(float(low), float(high), int(count))]
        except ValueError as err:
            raise ValueError(f"grid {text!r}: write logspace:LOW_EXP:HIGH_EXP:COUNT, e.g. "
                             "logspace:-5:-2:10") from err
    return [float(v) for v in text.split(",")]


def ema(values: Iterable[float], beta: float = 0.9) -> list[float]:
    """Exponential moving average of a curve, started at its first value (NaN stays NaN).

    Example::

        >>> ema([1.0, 0.0, 0.0], beta=0.5)
        [1.0, 0.5, 0.25]
    """
    out, average = [], None
    for v in values:
        average = v if average is None else beta * average + (1 - beta) * v
        out.append(average)
    return out


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    """Mean and (population) standard deviation of the finite values; NaNs when there are none.

    ``None``, NaN and inf entries (a run that never reached a target, a diverged run) are left
    out.

    Example::

        >>> mean_std([1.0, 3.0, None, float("nan")])
        (2.0, 1.0)
    """
    kept = [v for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return float("nan"), float("nan")
    return float(np.mean(kept)), float(np.std(kept))


def loss_spike(losses: Sequence[float], after: int) -> float:
    """Largest rise of a loss curve above its running minimum from step ``after`` on.

    .. math:: \\max_{t \\ge a} \\big(\\ell_t - \\min_{s \\le t} \\ell_s\\big)

    NaN when the curve is not longer than ``after``.

    Example::

        >>> loss_spike([3.0, 2.0, 2.5, 1.0], after=1)
        0.5
    """
    losses = np.asarray(losses, float)
    if len(losses) <= after:
        return float("nan")
    running_min = np.minimum.accumulate(losses)
    return float(np.max(losses[after:] - running_min[after:]))


def finite_or_inf(value: float) -> float:
    """``value``, or ``inf`` when it is NaN or infinite (so a diverged run ranks last)."""
    return value if math.isfinite(value) else math.inf


def best_cell(grid) -> tuple[int, ...]:
    """Index of the smallest entry of a score grid; NaN and inf entries never win.

    Example::

        >>> best_cell([[3.0, float("nan")], [1.0, 2.0]])
        (1, 0)
    """
    scores = np.where(np.isfinite(np.asarray(grid, float)), grid, np.inf)
    return tuple(int(i) for i in np.unravel_index(np.argmin(scores), scores.shape))


def count_within(grid, reference: float, tolerance: float) -> int:
    """How many entries of ``grid`` are at most ``reference · (1 + tolerance)``.

    Example::

        >>> count_within([1.0, 1.004, 1.02, float("inf")], 1.0, 0.005)
        2
    """
    return int(np.sum(np.asarray(grid, float) <= reference * (1 + tolerance)))


def fit_power_law(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares fit of ``log y = a · log x + c``: ``(a, c, standard error of a)``.

    The standard error is NaN with two points (no degree of freedom left).

    Example::

        >>> a, c, err = fit_power_law([1.0, 10.0, 100.0], [2.0, 20.0, 200.0])
        >>> round(a, 6), round(float(np.exp(c)), 6), round(err, 6)
        (1.0, 2.0, 0.0)
    """
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    design = np.stack([lx, np.ones_like(lx)], 1)
    coef, *_ = np.linalg.lstsq(design, ly, rcond=None)
    resid = ly - design @ coef
    dof = len(lx) - 2
    if dof > 0:
        stderr = math.sqrt(float(resid @ resid) / dof / float(((lx - lx.mean()) ** 2).sum()))
    else:
        stderr = float("nan")
    return float(coef[0]), float(coef[1]), stderr


def isoflop_optimum(sizes: Sequence[float], losses: Sequence[float]) -> dict:
    """The compute-optimal size of one isoFLOP curve: the vertex of ``loss ≈ q(log N)``.

    A parabola is fitted to ``(log N, loss)``; with no minimum (``q`` opens downward) the best
    measured size is returned instead. Returns ``{"quadratic": [a, b, c], "n_opt",
    "vertex_inside_grid", "min_loss"}``.

    Example::

        >>> n = np.exp([0.0, 1.0, 2.0, 3.0])
        >>> fit = isoflop_optimum(n, [(v - 1.5) ** 2 for v in np.log(n)])
        >>> round(float(np.log(fit["n_opt"])), 6), fit["vertex_inside_grid"]
        (1.5, True)
    """
    logn, loss = np.log(np.asarray(sizes, float)), np.asarray(losses, float)
    qa, qb, qc = np.polyfit(logn, loss, 2)
    interior = qa > 0 and logn.min() <= -qb / (2 * qa) <= logn.max()
    n_opt = float(np.exp(-qb / (2 * qa))) if qa > 0 else float(np.asarray(sizes)[np.argmin(loss)])
    return {"quadratic": [float(qa), float(qb), float(qc)], "n_opt": n_opt,
            "vertex_inside_grid": bool(interior), "min_loss": float(loss.min())}


__all__ = ["best_cell", "best_runs", "count_within", "ema", "finite_or_inf", "fit_power_law",
           "isoflop_optimum", "loss_spike", "mean_std", "moving_average", "parse_grid",
           "progress_target", "steps_to_target"]
