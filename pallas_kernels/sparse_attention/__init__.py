"""SALE: 4-bit estimated block selection + block-sparse prefill attention (Pallas + jnp twin)."""

from pallas_kernels.sparse_attention.api import (
    DEFAULT_TAU,
    BlockSizes,
    lookup_table,
    sale_prefill_attention,
)
from pallas_kernels.sparse_attention.reference import (
    QK4,
    SaleConfig,
    anchor_stats,
    block_sparse_attention_reference,
    calibrate_thresholds,
    quantize_qk_int4,
    sale_prefill_reference,
    sale_select_reference,
)

__all__ = ["DEFAULT_TAU", "QK4", "BlockSizes", "SaleConfig", "anchor_stats",
           "block_sparse_attention_reference", "calibrate_thresholds", "lookup_table",
           "quantize_qk_int4", "sale_prefill_attention", "sale_prefill_reference",
           "sale_select_reference"]
