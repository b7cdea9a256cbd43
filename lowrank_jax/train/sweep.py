"""Reading a sweep of training runs: best run per arm, steps to a target, smoothed curves.

A run is a ``dict`` (as a reproduction stores it in JSON), e.g. ``{"method": "lora",
"lr": 1e-3, "curve": [(step, held-out loss), ...], "final": 2.1}``; an arm's runs differ by
one setting (the learning rate) and the arm is reported at its best run.
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


__all__ = ["best_runs", "moving_average", "progress_target", "steps_to_target"]
