"""SALAAD deployment: homomorphic parameter allocation (HPA) and surrogate materialisation.

From one trained :class:`~lowrank_jax.optim.salaad.SalaadState`, :func:`hpa_allocate` picks per
leaf a rank of ``L`` and a number of kept entries of ``S`` so that the whole model fits a
parameter budget: the reduction ``ΔP = P_total − P*`` is split ``γ : 1−γ`` between the low-rank
and the sparse parts and applied as one *uniform* scale to every layer's rank and density (the
per-layer differences come from training). :func:`hpa_materialize` builds ``L̃ + S̃`` (factored or
dense) and :func:`apply_surrogate` writes the dense surrogates back into a parameter tree.

Counts: a rank-``r`` factor pair of an ``m×n`` leaf costs ``r(m+n)`` parameters, a sparse entry 1
(values only; indices are the storage format's business), every other leaf its size.
Host-side NumPy: this runs once after training, not inside ``jit``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from lowrank_jax.optim.factors import normalize_path
from lowrank_jax.optim.salaad import SalaadState


class HpaAllocation(NamedTuple):
    """Per selected leaf (path tuple): kept rank and kept sparse entries; the total count.

    Attributes:
        ranks: ``{path: r_l}``.
        nnz: ``{path: kept entries of S_l}``.
        n_params: parameters of the materialised model (rest + Σ r(m+n) + Σ nnz).
        target: the budget ``P*`` that was asked for.
    """

    ranks: dict
    nnz: dict
    n_params: int
    target: int


def _leaves(state: SalaadState) -> dict:
    lows = {normalize_path(p): np.asarray(x, np.float32)
            for p, x in jax.tree_util.tree_flatten_with_path(state.low_rank)[0]}
    sparse = {normalize_path(p): np.asarray(x, np.float32)
              for p, x in jax.tree_util.tree_flatten_with_path(state.sparse)[0]}
    return {p: (lows[p], sparse[p]) for p in lows if lows[p].ndim == 2}


def surrogate_counts(state: SalaadState) -> dict:
    """Per leaf ``(r_l, nnz_l, m, n)``: nuclear-energy-0.999 rank of ``L``, nonzeros of ``S``."""
    out = {}
    for path, (low, sparse) in _leaves(state).items():
        sigma = np.linalg.svd(low, compute_uv=False)
        total = sigma.sum()
        rank = int(np.sum(np.cumsum(sigma) / total < 0.999) + 1) if total > 0 else 0
        peak = np.abs(sparse).max()
        nnz = int(np.sum(np.abs(sparse) > peak / 1e8)) if peak > 0 else 0
        out[path] = (rank, nnz) + low.shape
    return out


def _count(n_rest: int, ranks: dict, nnz: dict, shapes: dict) -> int:
    return n_rest + sum(ranks[p] * (m + n) for p, (m, n) in shapes.items()) + sum(nnz.values())


def hpa_allocate(state: SalaadState, n_params_total: int, target_params: int, *,
                 gamma: float = 0.5) -> HpaAllocation:
    """Ranks and sparse entries per leaf for a model of at most ``target_params`` parameters.

    Args:
        state: the trained :class:`SalaadState`.
        n_params_total: parameters of the dense model (selected leaves at full size + the rest).
        target_params: the budget ``P*``.
        gamma: fraction of the reduction taken from the low-rank parts (the rest from ``S``);
            a side without enough capacity hands the remainder to the other.

    Returns:
        An :class:`HpaAllocation` with ``n_params <= target_params`` whenever the unselected
        leaves alone fit the budget (otherwise both parts are cut entirely).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"hpa_allocate: gamma={gamma} must lie in [0, 1].")
    if target_params <= 0:
        raise ValueError(f"hpa_allocate: target_params={target_params} must be positive.")
    counts = surrogate_counts(state)
    shapes = {p: (m, n) for p, (_, _, m, n) in counts.items()}
    n_rest = n_params_total - sum(m * n for m, n in shapes.values())
    if n_rest < 0:
        raise ValueError(
            f"hpa_allocate: n_params_total={n_params_total} is smaller than the selected leaves "
            f"({n_params_total - n_rest}); pass the dense model's parameter count."
        )
    ranks = {p: c[0] for p, c in counts.items()}
    nnz = {p: c[1] for p, c in counts.items()}
    p_low = sum(ranks[p] * (m + n) for p, (m, n) in shapes.items())
    p_sparse = sum(nnz.values())
    reduction = n_rest + p_low + p_sparse - target_params
    if reduction <= 0:  # the untruncated surrogate already fits
        return HpaAllocation(ranks, nnz, _count(n_rest, ranks, nnz, shapes), target_params)
    cut_low = int(np.floor(gamma * reduction))
    cut_sparse = reduction - cut_low
    if cut_low > p_low:
        cut_low, cut_sparse = p_low, cut_sparse + cut_low - p_low
    if cut_sparse > p_sparse:
        cut_low, cut_sparse = min(p_low, cut_low + cut_sparse - p_sparse), p_sparse
    keep_low = 1.0 - cut_low / p_low if p_low else 0.0
    keep_sparse = 1.0 - cut_sparse / p_sparse if p_sparse else 0.0
    new_ranks, new_nnz = {}, {}
    for p, (m, n) in shapes.items():
        q = min(1.0, max(0.0, ranks[p] / min(m, n) * keep_low))
        d = min(1.0, max(0.0, nnz[p] / (m * n) * keep_sparse))
        new_ranks[p] = int(np.floor(q * min(m, n) + 1e-9))
        new_nnz[p] = int(np.floor(d * m * n + 1e-9))
    gap = target_params - _count(n_rest, new_ranks, new_nnz, shapes)
    if gap > 0:  # post-fix: spend the rounding slack on sparse entries, proportionally to m·n
        area = sum(m * n for m, n in shapes.values())
        for p, (m, n) in shapes.items():
            new_nnz[p] = min(m * n, new_nnz[p] + int(np.floor(gap * m * n / area)))
    excess = _count(n_rest, new_ranks, new_nnz, shapes) - target_params
    for p in sorted(new_nnz, key=lambda p: -new_nnz[p]):  # guard against rounding overshoot
        if excess <= 0:
            break
        drop = min(excess, new_nnz[p])
        new_nnz[p] -= drop
        excess -= drop
    return HpaAllocation(new_ranks, new_nnz, _count(n_rest, new_ranks, new_nnz, shapes),
                         target_params)


def _truncate(low: np.ndarray, sparse: np.ndarray, rank: int, nnz: int):
    u, sigma, vt = np.linalg.svd(low, full_matrices=False)
    root = np.sqrt(sigma[:rank])
    left, right = u[:, :rank] * root, root[:, None] * vt[:rank]
    flat = np.abs(sparse).ravel()
    keep = np.argsort(-flat, kind="stable")[:nnz]
    rows, cols = np.unravel_index(keep, sparse.shape)
    return left, right, (rows, cols, sparse[rows, cols])


def hpa_materialize(state: SalaadState, allocation: HpaAllocation, *,
                    factored: bool = True) -> dict:
    """The surrogate of every selected leaf at the allocated rank and sparsity.

    Returns:
        ``{path: (U√σ [m, r], √σVᵀ [r, n], (rows, cols, values))}`` when ``factored``, else
        ``{path: dense L̃ + S̃}``.
    """
    out = {}
    for path, (low, sparse) in _leaves(state).items():
        left, right, (rows, cols, values) = _truncate(low, sparse, allocation.ranks[path],
                                                      allocation.nnz[path])
        if factored:
            out[path] = (left, right, (rows, cols, values))
        else:
            dense = left @ right
            dense[rows, cols] += values
            out[path] = dense
    return out


def apply_surrogate(params, state: SalaadState, allocation: HpaAllocation):
    """``params`` with every selected leaf replaced by its dense surrogate ``L̃ + S̃``."""
    dense = hpa_materialize(state, allocation, factored=False)

    def one(path, x):
        p = normalize_path(path)
        return jax.numpy.asarray(dense[p], x.dtype) if p in dense else x

    return jax.tree_util.tree_map_with_path(one, params)


__all__ = ["HpaAllocation", "apply_surrogate", "hpa_allocate", "hpa_materialize",
           "surrogate_counts"]
