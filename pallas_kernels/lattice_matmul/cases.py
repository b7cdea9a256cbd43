"""Lattice matmul entry points to prove on the hardware (:class:`pallas_kernels.aot.CompileCase`).

``compile_cases("production")``: a 4096 × 4096 UniSVQ-2 weight (2-bit digits, ``uint8`` codes,
128-wide Hadamard blocks) applied to 4096 bf16 tokens, in ``"fold"`` and ``"dequant"`` modes;
``"small"``: odd shapes (200 tokens, 72 inputs, 40 outputs, fp32, Hadamard blocks of 8). Every
``fn`` calls the public :func:`~pallas_kernels.lattice_matmul.api.lattice_matmul` with its
defaults (``implementation="auto"``). The kernel is inference-only (no backward entry). The GPU
backend is Triton (see :mod:`pallas_kernels.lattice_matmul.api`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.aot import CompileCase
from pallas_kernels.lattice_matmul.api import MODES, lattice_matmul

_SIZES = {
    # (tokens, in features, out features, Hadamard block, activation dtype)
    "production": [(4096, 4096, 4096, 128, jnp.bfloat16)],
    "small": [(200, 72, 40, 8, jnp.float32)],
}


def _layer(x, codes, scale_in, scale_out, affine, offset, *, mode, block):
    return lattice_matmul(x, codes, scale_in, scale_out, affine, offset, block_in=block,
                          block_out=block, mode=mode)


def compile_cases(size: str = "production") -> list[CompileCase]:
    """The lattice matmul cases at ``size`` (``"production"`` or ``"small"``).

    Example::

        >>> [c.entry for c in compile_cases("small")]
        ['fold', 'dequant']
    """
    if size not in _SIZES:
        raise ValueError(f"compile_cases: size={size!r}; use one of {sorted(_SIZES)}.")
    cases = []
    for t, n, m, block, dtype in _SIZES[size]:
        args = (jax.ShapeDtypeStruct((t, n), dtype), jax.ShapeDtypeStruct((m, n // 4), jnp.uint8),
                jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((m,), jnp.float32),
                jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))
        for mode in MODES:
            fn = functools.partial(_layer, mode=mode, block=block)
            cases.append(CompileCase("lattice_matmul", mode, fn, args, gpu_backend="triton"))
    return cases


__all__ = ["compile_cases"]
