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
    balancing_gap,
    balora,
    scale_by_balora,
)
from lowrank_jax.optim.crispedit import (
    CrispEditState,
    crispedit_adam,
    crispedit_refresh,
    needs_refresh,
    scale_by_crispedit,
)
from lowrank_jax.optim.factors import (
    find_pairs,
)
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    decoupled_margin_loss,
    janus,
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
from lowrank_jax.optim.spectron import (
    SpectronState,
    scale_by_spectron,
    spectron,
    spectron_with_adamw,
)

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
    salaad,
    salaad_admm_step,
    salaad_init,
    salaad_penalty,
    salaad_stats,
    scale_by_salaad,
)
from lowrank_jax.optim.salaad_deploy import (
    HpaAllocation,
    apply_surrogate,
    hpa_allocate,
    hpa_materialize,
)

__all__ = [
    "apply_surrogate",
    "balance_lora_params",
    "balancing_gap",
    "balora",
    "BaLoRAState",
    "communication_per_sync",
    "crispedit",
    "crispedit_adam",
    "crispedit_refresh",
    "CrispEditState",
    "decoupled_margin_loss",
    "find_lordo_state",
    "find_pairs",
    "find_salaad_state",
    "gao",
    "hpa_allocate",
    "hpa_materialize",
    "HpaAllocation",
    "janus",
    "loda",
    "loda_decompose",
    "loda_feature_stats",
    "loda_merge",
    "loda_recalibrate",
    "loda_update_memory",
    "LoDACovStat",
    "LoDASubspaces",
    "lordo",
    "lordo_sync",
    "max_update_norm",
    "needs_refresh",
    "oe_accumulate",
    "oe_finalize",
    "orthogonality_clamp",
    "outer_average",
    "outer_nesterov",
    "reanchor",
    "salaad",
    "salaad_admm_step",
    "salaad_init",
    "salaad_penalty",
    "salaad_stats",
    "SalaadConfig",
    "SalaadState",
    "scale_by_balora",
    "scale_by_crispedit",
    "scale_by_gao",
    "scale_by_input_projection",
    "scale_by_janus",
    "scale_by_lordo",
    "scale_by_salaad",
    "scale_by_spectron",
    "ScaleByLordoState",
    "ScaleBySalaadState",
    "set_projection",
    "set_subspaces",
    "simulate_ddp",
    "simulate_lordo",
    "spectron",
    "spectron_with_adamw",
    "SpectronState",
    "SubspaceMemory",
    "SyncResult",
    "with_subspaces",
    "WithSubspacesState",
]
