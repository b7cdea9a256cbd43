"""Compile-tier cases of dual-stream subspace attention (see :mod:`pallas_kernels.aot`).

``"production"``: bf16, head_dim 128, 32 heads (the op has no GQA), rank 32 for both projected
streams, 4096 and 8192 tokens, the default 64-token blocks and a banded near mask;
``"small"``: 200 tokens, head_dim 64, 4 heads, ranks 12 / 20 (odd, padded by the op).

Example::

    >>> [case.entry for case in compile_cases("small")]
    ['forward']
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.aot import CompileCase
from pallas_kernels.flash_attention.cases import check_size
from pallas_kernels.subspace_attention.api import BlockSizes, subspace_attention


def _shapes(size: str) -> list[tuple[int, int, int, int, int, int]]:
    """``(batch, tokens, heads, head_dim, rank, rank_v)`` of each case of ``size``."""
    check_size(size)
    if size == "production":
        return [(1, 4096, 32, 128, 32, 32), (1, 8192, 32, 128, 32, 32)]
    return [(1, 200, 4, 64, 12, 20)]


def _forward(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask):
    """Subspace attention with the op's defaults."""
    return subspace_attention(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask)


def compile_cases(size: str = "production") -> list[CompileCase]:
    """The forward entry at every shape of ``size`` (the near mask is an input)."""
    blocks = BlockSizes()
    cases = []
    for b, n, h, d, r, rv in _shapes(size):
        s = jax.ShapeDtypeStruct
        nq, nk = -(-n // blocks.block_q), -(-n // blocks.block_k)
        args = (s((b, n, h, d), jnp.bfloat16),) * 3 + (
            s((b, n, h, r), jnp.bfloat16), s((b, n, h, r), jnp.bfloat16),
            s((b, n, h, rv), jnp.bfloat16), s((h, d, rv), jnp.bfloat16), s((nq, nk), jnp.bool_))
        cases.append(CompileCase("subspace_attention", "forward", _forward, args))
    return cases


__all__ = ["compile_cases"]
