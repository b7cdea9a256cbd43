"""Round-to-nearest (RTN) scalar quantization: the baseline UniSVQ is measured against.

Each row of ``W [out, in]`` is cut into groups of ``group_size`` input coordinates; a group with
minimum ``lo`` and maximum ``hi`` gets an asymmetric grid

.. math::
    s = (hi - lo)/(2^{bits} - 1),\\quad
    q = \\mathrm{clip}(\\mathrm{round}((w - lo)/s), 0, 2^{bits}-1),
    \\quad \\hat w = q·s + lo

with ``s`` (scale) and ``lo`` (zero) stored in fp16: ``bits + 32/group_size`` bits per weight.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from lowrank_jax.quant.packing import pack_bits, rtn_bits_per_weight, unpack_bits

SUPPORTED_BITS = (2, 3, 4, 8)


class RTNWeight(NamedTuple):
    """A group-wise RTN matrix ``[out, in]``: ``ŵ = codes·scale + zero`` per group."""

    codes: UInt8[Array, "m n"]  # unpacked digits 0..2^bits-1 (packed only on disk)
    scale: Float[Array, "m g"]
    zero: Float[Array, "m g"]
    bits: int
    group_size: int


def check_bits(bits: int, supported=SUPPORTED_BITS, where: str = "bits") -> None:
    """Raise a ``ValueError`` naming ``where`` unless ``bits`` is in ``supported``."""
    if isinstance(bits, bool) or bits not in supported:
        raise ValueError(f"{where}={bits!r} is not supported; use one of {tuple(supported)}.")


def check_group_size(group_size: int | None, n: int) -> int:
    """The effective group size; ``ValueError`` if it does not divide the input dim ``n``."""
    if group_size is None:
        return n
    if not isinstance(group_size, (int, np.integer)) or group_size < 1 or n % group_size:
        raise ValueError(
            f"group_size={group_size!r} must be a positive divisor of the input dim {n}; "
            f"pick e.g. {max(d for d in (32, 64, 128, n) if n % d == 0)} or None (per row)."
        )
    return int(group_size)


def rtn_quantize(
    weight: Float[Array, "m n"], bits: int = 4, group_size: int | None = 64
) -> RTNWeight:
    """Quantize ``weight [out, in]`` by group-wise asymmetric round-to-nearest.

    Args:
        weight: the matrix ``W`` with ``y = W x`` (rows = outputs).
        bits: 2, 3, 4 or 8.
        group_size: input coordinates per scale/zero pair (must divide ``in``); ``None`` = per row.

    Returns:
        An :class:`RTNWeight`.

    Example::

        >>> import jax.numpy as jnp
        >>> w = jnp.array([[0.0, 1.0, 2.0, 3.0]])
        >>> q = rtn_quantize(w, bits=2, group_size=4)
        >>> rtn_dequantize(q).tolist()
        [[0.0, 1.0, 2.0, 3.0]]

    References:
        Frantar et al, `GPTQ <https://arxiv.org/abs/2210.17323>`_, 2022 (the RTN baseline there).
    """
    check_bits(bits)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {weight.shape}.")
    m, n = weight.shape
    group = check_group_size(group_size, n)
    w = weight.astype(jnp.float32).reshape(m, n // group, group)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    levels = 2**bits - 1
    scale = jnp.maximum(hi - lo, 1e-8) / levels
    # store scale/zero in fp16 precision so that the accounting matches what is used
    scale = scale.astype(jnp.float16).astype(jnp.float32)
    lo = lo.astype(jnp.float16).astype(jnp.float32)
    q = jnp.clip(jnp.round((w - lo[..., None]) / scale[..., None]), 0, levels)
    return RTNWeight(q.reshape(m, n).astype(jnp.uint8), scale, lo, bits, group)


def rtn_dequantize(q: RTNWeight) -> Float[Array, "m n"]:
    """Dense fp32 ``[out, in]`` from an :class:`RTNWeight`."""
    m, n = q.codes.shape
    z = q.codes.astype(jnp.float32).reshape(m, n // q.group_size, q.group_size)
    return (z * q.scale[..., None] + q.zero[..., None]).reshape(m, n)


def rtn_to_arrays(q: RTNWeight) -> dict:
    """Storage form: the bit-packed code stream + fp16 scale and zero."""
    return {
        "codes": pack_bits(np.asarray(q.codes), q.bits),
        "scale": np.asarray(q.scale, np.float16),
        "zero": np.asarray(q.zero, np.float16),
    }


def rtn_from_arrays(arrays: dict, shape: tuple[int, int], bits: int, group_size: int) -> RTNWeight:
    """Inverse of :func:`rtn_to_arrays`."""
    m, n = shape
    codes = unpack_bits(np.asarray(arrays["codes"]), bits, m * n).reshape(m, n)
    return RTNWeight(jnp.asarray(codes), jnp.asarray(arrays["scale"], jnp.float32),
                     jnp.asarray(arrays["zero"], jnp.float32), bits, group_size)


__all__ = [
    "RTNWeight",
    "SUPPORTED_BITS",
    "check_bits",
    "check_group_size",
    "rtn_bits_per_weight",
    "rtn_dequantize",
    "rtn_from_arrays",
    "rtn_quantize",
    "rtn_to_arrays",
]
