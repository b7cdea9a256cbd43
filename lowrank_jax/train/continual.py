"""Continual-learning bookkeeping: the accuracy matrix and its ACC / BWT / FWT summaries.

``R[i, j]`` is the accuracy on task ``j`` after training on tasks ``0..i`` (``T × T``).

.. math::
   \\mathrm{ACC} = \\frac1T \\sum_j R_{T-1,j},\\quad
   \\mathrm{BWT} = \\frac{1}{T-1} \\sum_{j<T-1} (R_{T-1,j} - R_{j,j}),\\quad
   \\mathrm{FWT} = \\frac{1}{T-1} \\sum_{j>0} (R_{j-1,j} - b_j)

with ``b_j`` the accuracy of the untrained model on task ``j`` (Lopez-Paz & Ranzato,
`GEM <https://arxiv.org/abs/1706.08840>`_, 2017). In a class-incremental stream a task's classes
are not yet in the classifier before it is trained, so ``R[j-1, j] = 0`` and FWT is ``-mean(b)``
by construction; it is meaningful for task- or domain-incremental streams.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ContinualMetrics:
    acc: float
    bwt: float
    fwt: float | None


def continual_metrics(matrix, baseline=None) -> ContinualMetrics:
    """ACC, BWT and (with ``baseline`` accuracies of the untrained model) FWT of ``R``."""
    r = np.asarray(matrix, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] < 1:
        raise ValueError(f"accuracy matrix must be square [tasks, tasks], got shape {r.shape}.")
    t = r.shape[0]
    acc = float(r[-1].mean())
    bwt = float(np.mean([r[-1, j] - r[j, j] for j in range(t - 1)])) if t > 1 else 0.0
    fwt = None
    if baseline is not None:
        b = np.asarray(baseline, dtype=np.float64)
        if b.shape != (t,):
            raise ValueError(f"baseline must have one accuracy per task ({t}), got {b.shape}.")
        fwt = float(np.mean([r[j - 1, j] - b[j] for j in range(1, t)])) if t > 1 else 0.0
    return ContinualMetrics(acc, bwt, fwt)
