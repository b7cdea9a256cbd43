"""Optimizers as optax GradientTransformations, and the linear algebra they share."""

from lowrank_jax.optim.factors import (
    default_pair_fn,
    factor_pairs,
    factor_roles,
    label_factors,
)
from lowrank_jax.optim.linalg import (
    newton_schulz,
    polar,
    power_iteration,
    randomized_svd,
    spectral_norm_exact,
)
from lowrank_jax.optim.spectron import (
    SpectronState,
    scale_by_spectron,
    spectron,
    spectron_with_adamw,
)

__all__ = [
    "SpectronState",
    "default_pair_fn",
    "factor_pairs",
    "factor_roles",
    "label_factors",
    "newton_schulz",
    "polar",
    "power_iteration",
    "randomized_svd",
    "scale_by_spectron",
    "spectral_norm_exact",
    "spectron",
    "spectron_with_adamw",
]
