"""PLoRA grouped LoRA kernels: rank-aware shrink / expand over tokens sorted by adapter."""

from pallas_kernels.grouped_lora.api import IMPLEMENTATIONS, BlockSizes, lora_expand, lora_shrink
from pallas_kernels.grouped_lora.reference import (
    group_ids,
    grouped_lora_loop_reference,
    lora_expand_reference,
    lora_shrink_reference,
    rank_mask,
)

__all__ = [
    "BlockSizes",
    "IMPLEMENTATIONS",
    "group_ids",
    "grouped_lora_loop_reference",
    "lora_expand",
    "lora_expand_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "rank_mask",
]
