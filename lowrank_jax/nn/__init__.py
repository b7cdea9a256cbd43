"""Flax NNX layers: LoRA, natively factorized linears, and adapter injection."""

from lowrank_jax.nn.factorized import FactorizedLinear, LowRankFactor, balanced_factors
from lowrank_jax.nn.inject import (
    LoRARule,
    apply_lora,
    linear_paths,
    lora_layers,
    merge_lora,
    remove_lora,
    unmerge_lora,
)
from lowrank_jax.nn.init import gap_direction, init_lora, init_lora_model
from lowrank_jax.nn.lokra import LoKRAPlusLinear, kruskal_penalty, lokra_regularizer
from lowrank_jax.nn.lora import LoRALinear, lora_scaling
from lowrank_jax.nn.multi_lora import (
    AdapterIds,
    MultiLoRALinear,
    apply_multi_lora,
    multi_lora_layers,
    set_adapter_ids,
)
from lowrank_jax.nn.rank_plan import allocate_ranks, plan_ranks, probe_importance

__all__ = [
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
    "kruskal_penalty",
    "lokra_regularizer",
    "plan_ranks",
    "probe_importance",
    "LoRALinear",
    "LoRARule",
    "LowRankFactor",
    "apply_lora",
    "balanced_factors",
    "linear_paths",
    "lora_layers",
    "lora_scaling",
    "merge_lora",
    "remove_lora",
    "unmerge_lora",
]
