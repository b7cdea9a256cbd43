"""Kruskal rank, coherence and the Kruskal penalty.

They live at the ground floor, :mod:`lowrank_jax.core.kruskal`.
"""

from lowrank_jax.core.kruskal import (
    PenaltyKind,
    coherence,
    khatri_rao,
    kruskal_penalty,
    kruskal_rank_bounds,
    kruskal_rank_exact,
    numerical_krank,
)

__all__ = [
    "PenaltyKind",
    "coherence",
    "khatri_rao",
    "kruskal_penalty",
    "kruskal_rank_bounds",
    "kruskal_rank_exact",
    "numerical_krank",
]
