"""Compile-tier cases of xKV decode attention (see :mod:`pallas_kernels.aot`).

``"production"``: one new token of an 8B-class layer (bf16, 32 query / 8 KV heads, head_dim 128)
over a 4096- and an 8192-token xKV-4 compressed prompt (ranks 384 / 576) plus a 256-token exact
tail; ``"small"``: a 200-token prompt, head_dim 64, GQA 4/2, ranks 12 / 20, a 7-token tail.

Example::

    >>> [case.entry for case in compile_cases("small")]
    ['decode']
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.aot import CompileCase
from pallas_kernels.flash_attention.cases import check_size
from pallas_kernels.xkv_decode.api import xkv_decode_attention

#: The RoPE base of the cases (Llama 3's).
ROPE_THETA = 5e5


def _shapes(size: str) -> list[tuple[int, ...]]:
    """``(batch, prompt, tail, heads, kv_heads, head_dim, rank_k, rank_v)`` per case."""
    check_size(size)
    if size == "production":
        return [(1, 4096, 256, 32, 8, 128, 384, 576), (1, 8192, 256, 32, 8, 128, 384, 576)]
    return [(1, 200, 7, 4, 2, 64, 12, 20)]


def decode(q, key_factor, key_basis, value_factor, value_basis, tail_keys, tail_values):
    """xKV decode attention with the op's defaults."""
    return xkv_decode_attention(q, key_factor, key_basis, value_factor, value_basis,
                                rope_theta=ROPE_THETA, tail_keys=tail_keys,
                                tail_values=tail_values)


def compile_cases(size: str = "production") -> list[CompileCase]:
    """The decode entry at every shape of ``size``."""
    cases = []
    for b, length, tail, h, hk, d, rk, rv in _shapes(size):
        s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
        args = (s((b, h, d), bf), s((b, length, rk), bf), s((b, hk, rk, d), bf),
                s((b, length, rv), bf), s((b, hk, rv, d), bf), s((b, tail, hk, d), bf),
                s((b, tail, hk, d), bf))
        cases.append(CompileCase("xkv_decode", "decode", decode, args))
    return cases


__all__ = ["ROPE_THETA", "compile_cases", "decode"]
