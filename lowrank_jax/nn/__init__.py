"""Flax NNX layers: LoRA, natively factorized linears, and adapter injection."""

from lowrank_jax.nn.capture import capture
from lowrank_jax.nn.factorized import (
    FactorizedLinear,
    FactorizedProjection,
    LowRankFactor,
    balanced_factors,
    factorize,
)
from lowrank_jax.nn.inject import (
    LoRARule,
    apply_lora,
    lora_layers,
    merge_lora,
    remove_lora,
    unmerge_lora,
)
from lowrank_jax.nn.init import gap_direction, init_lora, init_lora_model, peft_lora_state
from lowrank_jax.nn.lokra import LoKRAPlusLinear, kruskal_penalty, lokra_regularizer
from lowrank_jax.nn.lora import (
    LoRA,
    LoRALinear,
    LoRAProjection,
    QLoRALinear,
    lora_output,
    lora_scaling,
)
from lowrank_jax.nn.merge import merge_adapters
from lowrank_jax.nn.multi_lora import (
    AdapterIds,
    MultiLoRALinear,
    apply_multi_lora,
    multi_lora_layers,
    set_adapter_ids,
)
from lowrank_jax.nn.projection import (
    DenseProjection,
    ProjectionView,
    is_projection,
    ReadsThrough,
    dense_matrix,
    projection_paths,
    projection_view,
    register_projection,
    set_kernel_from_matrix,
)
from lowrank_jax.nn.rank_plan import allocate_ranks, plan_ranks, probe_importance

__all__ = [
    "DenseProjection",
    "FactorizedProjection",
    "LoRAProjection",
    "ProjectionView",
    "QLoRALinear",
    "LoRA",
    "ReadsThrough",
    "capture",
    "dense_matrix",
    "merge_adapters",
    "factorize",
    "is_projection",
    "projection_paths",
    "projection_view",
    "register_projection",
    "set_kernel_from_matrix",
    "AdapterIds",
    "FactorizedLinear",
    "MultiLoRALinear",
    "apply_multi_lora",
    "multi_lora_layers",
    "set_adapter_ids",
    "LoKRAPlusLinear",
    "allocate_ranks",
    "gap_direction",
    "init_lora",
    "init_lora_model",
    "peft_lora_state",
    "kruskal_penalty",
    "lokra_regularizer",
    "plan_ranks",
    "probe_importance",
    "LoRALinear",
    "LoRARule",
    "LowRankFactor",
    "apply_lora",
    "balanced_factors",
    "lora_layers",
    "lora_output",
    "lora_scaling",
    "merge_lora",
    "remove_lora",
    "unmerge_lora",
]
