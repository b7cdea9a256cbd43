"""Grouped LoRA entry points to prove on the hardware (:class:`pallas_kernels.aot.CompileCase`).

``compile_cases("production")``: 8 adapters of rank 16 over a 4096-wide bf16 projection, 4096
and 8192 tokens — shrink and expand forward, and their backward (``jax.value_and_grad`` of a
scalar through the public op: the forward kernel plus the backward kernels). ``"small"``: odd
shapes (200 tokens, d 72, rank 8, 3 adapters) in fp32. Every ``fn`` calls the public op with its
defaults (``implementation="auto"``), so on a TPU / GPU target it must hold the Pallas kernels.
The GPU backend is Triton (see :mod:`pallas_kernels.grouped_lora.api`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.aot import CompileCase
from pallas_kernels.grouped_lora.api import lora_expand, lora_shrink

_SIZES = {
    # (tokens, d, adapters, padded rank, dtype)
    "production": [(4096, 4096, 8, 16, jnp.bfloat16), (8192, 4096, 8, 16, jnp.bfloat16)],
    "small": [(200, 72, 3, 8, jnp.float32)],
}


def _shrink(x, a, group_sizes, scale, ranks):
    return lora_shrink(x, a, group_sizes, scale, ranks)


def _expand(h, b, group_sizes, ranks):
    return lora_expand(h, b, group_sizes, ranks)


def _shrink_backward(x, a, group_sizes, scale, ranks):
    def loss(x, a, scale):
        return 0.5 * jnp.sum(jnp.square(lora_shrink(x, a, group_sizes, scale, ranks)))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, a, scale)


def _expand_backward(h, b, group_sizes, ranks):
    def loss(h, b):
        return 0.5 * jnp.sum(jnp.square(lora_expand(h, b, group_sizes, ranks)))

    return jax.value_and_grad(loss, argnums=(0, 1))(h, b)


def compile_cases(size: str = "production") -> list[CompileCase]:
    """The grouped LoRA cases at ``size`` (``"production"`` or ``"small"``).

    Example::

        >>> [c.entry for c in compile_cases("small")]
        ['shrink', 'expand', 'shrink_backward', 'expand_backward']
    """
    if size not in _SIZES:
        raise ValueError(f"compile_cases: size={size!r}; use one of {sorted(_SIZES)}.")
    cases = []
    for n, d, k, r, dtype in _SIZES[size]:
        meta_int = jax.ShapeDtypeStruct((k,), jnp.int32)
        scale = jax.ShapeDtypeStruct((k,), jnp.float32)
        x = jax.ShapeDtypeStruct((n, d), dtype)
        a = jax.ShapeDtypeStruct((k, d, r), dtype)
        h = jax.ShapeDtypeStruct((n, r), dtype)
        b = jax.ShapeDtypeStruct((k, r, d), dtype)
        shrink_args = (x, a, meta_int, scale, meta_int)
        expand_args = (h, b, meta_int, meta_int)
        for entry, fn, args in (("shrink", _shrink, shrink_args),
                                ("expand", _expand, expand_args),
                                ("shrink_backward", _shrink_backward, shrink_args),
                                ("expand_backward", _expand_backward, expand_args)):
            cases.append(CompileCase("grouped_lora", entry, fn, args, gpu_backend="triton"))
    return cases


__all__ = ["compile_cases"]
