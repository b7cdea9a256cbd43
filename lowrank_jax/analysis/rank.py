"""Spectrum-based ranks (effective, stable, numerical, energy, RankMe, α-ReQ).

They live at the ground floor, :mod:`lowrank_jax.core.rank`.
"""

from lowrank_jax.core.rank import (
    alpha_req,
    anisotropy,
    effective_rank,
    effective_rank_of,
    energy_rank,
    energy_rank_of,
    isotropy_partition,
    numerical_rank,
    numerical_rank_of,
    rankme,
    stable_rank,
    stable_rank_of,
)

__all__ = [
    "alpha_req",
    "anisotropy",
    "effective_rank",
    "effective_rank_of",
    "energy_rank",
    "energy_rank_of",
    "isotropy_partition",
    "numerical_rank",
    "numerical_rank_of",
    "rankme",
    "stable_rank",
    "stable_rank_of",
]
