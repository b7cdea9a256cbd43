"""Optimizers as optax GradientTransformations, and the linear algebra they share.

Every method has optax's two-level shape: ``scale_by_<method>`` (the algorithm) and an alias
(``spectron``, ``balora``, ``janus``, ``gao``; CrispEdit's is
``lowrank_jax.optim.crispedit.crispedit`` because ``lowrank_jax.optim.crispedit`` stays the
module). Factor pairs are found by
:func:`find_pairs` (:mod:`lowrank_jax.optim.factors`), linear algebra lives in
:mod:`lowrank_jax.optim.linalg`.
"""

from lowrank_jax.optim.balora import (
    BaLoRAState,
    balance_lora_params,
    balance_pair,
    balancing_gap,
    balora,
    find_lora_pairs,
    scale_by_balora,
)
from lowrank_jax.optim.crispedit import (
    CrispEditState,
    LayerProjector,
    build_projector,
    crispedit_adam,
    crispedit_refresh,
    kron_project,
    needs_refresh,
    scale_by_crispedit,
)
from lowrank_jax.optim.factors import (
    default_pair_fn,
    factor_pairs,
    factor_roles,
    find_pairs,
    label_factors,
    lora_pairs,
)
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    decoupled_margin_loss,
    janus,
    janus_rectify,
    oe_accumulate,
    oe_finalize,
    orthogonality_clamp,
    reanchor,
    scale_by_janus,
)
from lowrank_jax.optim import crispedit, loda  # modules (their transforms share the name)
from lowrank_jax.optim.loda import CovStat as LoDACovStat
from lowrank_jax.optim.loda import LoDASubspaces, gao, scale_by_gao
from lowrank_jax.optim.loda import decompose as loda_decompose
from lowrank_jax.optim.loda import feature_stats as loda_feature_stats
from lowrank_jax.optim.loda import merge as loda_merge
from lowrank_jax.optim.loda import recalibrate as loda_recalibrate
from lowrank_jax.optim.loda import update_memory as loda_update_memory
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
    "LoDACovStat",
    "LoDASubspaces",
    "gao",
    "loda",
    "loda_decompose",
    "loda_feature_stats",
    "loda_merge",
    "loda_recalibrate",
    "loda_update_memory",
    "CrispEditState",
    "LayerProjector",
    "build_projector",
    "crispedit",
    "crispedit_adam",
    "crispedit_refresh",
    "kron_project",
    "needs_refresh",
    "scale_by_crispedit",
    "scale_by_gao",
    "scale_by_janus",
    "find_pairs",
    "janus",
    "lora_pairs",
    "BaLoRAState",
    "SubspaceMemory",
    "balance_lora_params",
    "balance_pair",
    "balancing_gap",
    "balora",
    "decoupled_margin_loss",
    "find_lora_pairs",
    "janus_rectify",
    "oe_accumulate",
    "oe_finalize",
    "orthogonality_clamp",
    "reanchor",
    "scale_by_balora",
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
