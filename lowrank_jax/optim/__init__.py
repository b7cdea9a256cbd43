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
    factor_roles,
    find_pairs,
)
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    decoupled_margin_loss,
    janus,
    janus_rectify,
    oe_accumulate,
    oe_finalize,
    orthogonality_clamp,
    WithSubspacesState,
    reanchor,
    scale_by_input_projection,
    scale_by_janus,
    set_subspaces,
    with_subspaces,
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
    "scale_by_input_projection",
    "set_subspaces",
    "with_subspaces",
    "WithSubspacesState",
    "find_pairs",
    "janus",
    "BaLoRAState",
    "SubspaceMemory",
    "balance_lora_params",
    "balance_pair",
    "balancing_gap",
    "balora",
    "decoupled_margin_loss",
    "janus_rectify",
    "oe_accumulate",
    "oe_finalize",
    "orthogonality_clamp",
    "reanchor",
    "scale_by_balora",
    "SpectronState",
    "factor_roles",
    "newton_schulz",
    "polar",
    "power_iteration",
    "randomized_svd",
    "scale_by_spectron",
    "spectral_norm_exact",
    "spectron",
    "spectron_with_adamw",
]

# LoRDO and SALAAD (issue 25)
from lowrank_jax.optim.lordo import (
    ScaleByLordoState,
    find_lordo_state,
    lordo,
    scale_by_lordo,
)
from lowrank_jax.optim.lordo_distributed import (
    SyncResult,
    communication_per_sync,
    lordo_sync,
    outer_average,
    outer_nesterov,
    set_projection,
)
from lowrank_jax.optim.lordo_simulation import simulate_ddp, simulate_lordo
from lowrank_jax.optim.update_norm import max_update_norm
from lowrank_jax.optim.salaad import (
    SalaadConfig,
    SalaadState,
    ScaleBySalaadState,
    find_salaad_state,
    penalty_gradient,
    salaad,
    salaad_admm_step,
    salaad_init,
    salaad_penalty,
    salaad_stats,
    scale_by_salaad,
    soft_threshold,
    svt,
)
from lowrank_jax.optim.salaad_deploy import (
    HpaAllocation,
    apply_surrogate,
    hpa_allocate,
    hpa_materialize,
    surrogate_counts,
)

__all__ += [
    "HpaAllocation",
    "SalaadConfig",
    "SalaadState",
    "ScaleByLordoState",
    "ScaleBySalaadState",
    "SyncResult",
    "apply_surrogate",
    "communication_per_sync",
    "find_lordo_state",
    "find_salaad_state",
    "hpa_allocate",
    "hpa_materialize",
    "lordo",
    "lordo_sync",
    "outer_average",
    "outer_nesterov",
    "penalty_gradient",
    "salaad",
    "salaad_admm_step",
    "salaad_init",
    "salaad_penalty",
    "salaad_stats",
    "scale_by_lordo",
    "scale_by_salaad",
    "set_projection",
    "simulate_ddp",
    "simulate_lordo",
    "max_update_norm",
    "soft_threshold",
    "surrogate_counts",
    "svt",
]
