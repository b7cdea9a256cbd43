"""The optimizers' linear algebra: Newton–Schulz, polar, power iteration, randomized SVD.

The code lives at the ground floor, :mod:`lowrank_jax.core.linalg` (shared with analysis, data
and kv); this module keeps the optimizers' import path.
"""

from lowrank_jax.core.linalg import (
    MUON_COEFFS,
    Numeric,
    gathered,
    newton_schulz,
    polar,
    power_iteration,
    randomized_svd,
    spectral_norm_exact,
    with_sharding_of,
)

__all__ = [
    "MUON_COEFFS",
    "Numeric",
    "gathered",
    "newton_schulz",
    "polar",
    "power_iteration",
    "randomized_svd",
    "spectral_norm_exact",
    "with_sharding_of",
]
