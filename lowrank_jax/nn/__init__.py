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
from lowrank_jax.nn.lora import LoRALinear, lora_scaling

__all__ = [
    "FactorizedLinear",
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
