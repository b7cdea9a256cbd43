"""Compile-tier cases of flash attention: forward and backward through the public op.

``compile_cases(size)`` lists :class:`pallas_kernels.aot.CompileCase` entries that the compile
tier (``tests/pallas_kernels/test_compile_tier.py``) and ``scripts/gpu/compile_matrix.py`` compile
for TPU and lower for GPU. ``"production"``: an 8B-class layer (bf16, head_dim 128, GQA 32 query /
8 KV heads, batch 1, 4096 and 8192 tokens); ``"small"``: odd small shapes (200 tokens, head_dim
64, GQA 4/2) that exercise padding.

Example::

    >>> [case.entry for case in compile_cases("small")]
    ['forward', 'backward', 'backward_masked']
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.aot import CompileCase
from pallas_kernels.flash_attention.api import flash_attention

_SIZES = ("production", "small")


def check_size(size: str) -> None:
    """Refuse a case size that is not one of ``_SIZES``."""
    if size not in _SIZES:
        raise ValueError(f"compile_cases: size={size!r} must be one of {_SIZES}.")


def attention_shapes(size: str) -> list[tuple[int, int, int, int, int, jnp.dtype]]:
    """``(batch, tokens, heads, kv_heads, head_dim, dtype)`` of each case of ``size``."""
    check_size(size)
    if size == "production":
        return [(1, 4096, 32, 8, 128, jnp.bfloat16), (1, 8192, 32, 8, 128, jnp.bfloat16)]
    return [(1, 200, 4, 2, 64, jnp.bfloat16)]


def qkv_structs(b, t, h, hk, d, dtype) -> tuple:
    """``q, k, v`` as ``jax.ShapeDtypeStruct`` in the dispatcher layout ``[b, t, heads, d]``."""
    q = jax.ShapeDtypeStruct((b, t, h, d), dtype)
    kv = jax.ShapeDtypeStruct((b, t, hk, d), dtype)
    return q, kv, kv


def _forward(q, k, v):
    """Causal flash attention with the op's defaults."""
    return flash_attention(q, k, v)


def backward(q, k, v):
    """``(dq, dk, dv)`` of a scalar of the output: the training path through the custom VJP."""
    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def backward_masked(q, k, v, q_segments, kv_segments):
    """The gradient with every mask option: sliding window, soft-cap, packed-row segments."""
    def loss(q, k, v):
        out = flash_attention(q, k, v, window=64, logit_softcap=50.0,
                              segment_ids=(q_segments, kv_segments))
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def compile_cases(size: str = "production") -> list[CompileCase]:
    """Forward and backward of :func:`flash_attention` at every shape of ``size`` (small:
    also the masked backward)."""
    cases = []
    for shape in attention_shapes(size):
        args = qkv_structs(*shape)
        cases.append(CompileCase("flash_attention", "forward", _forward, args))
        cases.append(CompileCase("flash_attention", "backward", backward, args))
        if size == "small":
            segments = (jax.ShapeDtypeStruct(shape[:2], jnp.int32),) * 2
            cases.append(CompileCase("flash_attention", "backward_masked", backward_masked,
                                     args + segments))
    return cases


__all__ = ["attention_shapes", "backward", "backward_masked", "check_size",
           "compile_cases", "qkv_structs"]
