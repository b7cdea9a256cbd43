"""Compile-tier cases of SALE sparse prefill attention (see :mod:`pallas_kernels.aot`).

``"production"``: bf16, head_dim 128, GQA 32 / 8 heads, 4096 and 8192 tokens (above
``SaleConfig.dense_below``, so the sparse kernels run); ``"small"``: 200 tokens at head_dim 64
with ``dense_below=0`` (the sparse path at an odd length).

Example::

    >>> [case.entry for case in compile_cases("small")]
    ['prefill']
"""

from __future__ import annotations

from pallas_kernels.aot import CompileCase
from pallas_kernels.flash_attention.cases import attention_shapes, qkv_structs
from pallas_kernels.sparse_attention.api import sale_prefill_attention
from pallas_kernels.sparse_attention.reference import SaleConfig


def prefill(q, k, v):
    """SALE prefill with the op's defaults (threshold, config, implementation)."""
    return sale_prefill_attention(q, k, v)


def prefill_short(q, k, v):
    """SALE prefill with the sparse path forced on a short sequence (``dense_below=0``)."""
    return sale_prefill_attention(q, k, v, cfg=SaleConfig(dense_below=0))


def compile_cases(size: str = "production") -> list[CompileCase]:
    """The prefill entry at every shape of ``size``."""
    fn = prefill if size == "production" else prefill_short
    return [CompileCase("sparse_attention", "prefill", fn, qkv_structs(*shape))
            for shape in attention_shapes(size)]


__all__ = ["compile_cases", "prefill", "prefill_short"]
