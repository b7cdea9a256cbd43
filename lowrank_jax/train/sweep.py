"""Comparing the runs of a sweep: value grids, smoothed loss curves, steps to a target, the best
cell of a grid and how many cells come close to it (host-side NumPy, no JAX).

A sweep trains one run per cell of a hyperparameter grid (a learning rate, a scale, ...) and
ranks the cells by a score of each run's loss curve, usually the last value of the curve
smoothed by an exponential moving average

.. math::
   \\bar\\ell_0 = \\ell_0, \\qquad
   \\bar\\ell_t = \\beta\\,\\bar\\ell_{t-1} + (1-\\beta)\\,\\ell_t .

A method is *robust* to the grid when many cells end within a tolerance of its best one
(:func:`count_within`), and *fast* when its curve reaches a target loss in few steps
(:func:`steps_to_target`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


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


def running_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Means of every ``window`` consecutive values (``len(values) - window + 1`` of them).

    Example::

        >>> running_mean([1.0, 2.0, 3.0, 4.0], 2).tolist()
        [1.5, 2.5, 3.5]
    """
    window = max(1, int(window))
    return np.convolve(np.asarray(values, float), np.ones(window) / window, mode="valid")


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


def steps_to_target(curve: Iterable[float], target: float) -> int | None:
    """Steps until ``curve`` first reaches ``target`` (``curve[i] <= target`` after ``i + 1``
    steps), or ``None`` when it never does.

    Example::

        >>> steps_to_target([3.0, 2.0, 1.0], 2.0), steps_to_target([3.0], 1.0)
        (2, None)
    """
    for i, v in enumerate(curve):
        if v <= target:
            return i + 1
    return None


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


__all__ = ["best_cell", "count_within", "ema", "finite_or_inf", "fit_power_law",
           "isoflop_optimum", "loss_spike", "mean_std", "parse_grid", "running_mean",
           "steps_to_target"]
