"""Round-to-nearest (RTN) scalar quantization: the naive baseline UniSVQ is measured against.

Each row of ``W [out, in]`` is cut into groups of ``group_size`` input coordinates. Two forms:

* ``zero_point="integer"`` (default; the textbook / GPTQ form). With ``lo' = min(lo, 0)``,
  ``hi' = max(hi, 0)`` of the group:

  .. math::
      s = (hi' - lo')/(2^{bits} - 1),\\quad z = \\mathrm{round}(-lo'/s),\\quad
      q = \\mathrm{clip}(\\mathrm{round}(w/s) + z, 0, 2^{bits}-1),\\quad \\hat w = (q - z)·s

  ``s`` in fp16 and the integer ``z`` in ``bits`` bits: ``bits + (16 + bits)/group_size`` bits per
  weight. **Zero is a grid point** (``q = z`` decodes to exactly 0).
* ``zero_point="float"`` (the variant kept for comparison): ``s = (hi - lo)/(2^{bits}-1)``,
  ``q = clip(round((w - lo)/s))``, ``ŵ = q·s + lo`` with fp16 ``lo``: ``bits + 32/group_size``.
  The grid is fitted to ``[lo, hi]`` exactly, but 0 is in general **not** a grid point.

Why the forms differ at 3 bits (measured on SmolLM2, see ``docs/results/unisvq.md``): weights are
peaked at 0, so most of a group lies near 0. With the float offset, 0 falls at an arbitrary
fraction of a step between two levels, and all those near-zero weights round to the *same* nearest
level: an error of the same sign, up to ``s/2``, on most of the group. Such a per-group bias does
not average out in ``W x``: it adds ``δ·Σ_group x`` to every output, and Llama activations have
large-mean channels. The integer zero-point maps near-zero weights to exactly 0 (no bias), paying
at most ``s/2`` of clipping at one end of the range.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from lowrank_jax.quant.packing import pack_bits, rtn_bits_per_weight, unpack_bits

#: Bit widths of round-to-nearest quantization.
SUPPORTED_BITS = (2, 3, 4, 8)


#: How the per-group zero point is stored: rounded to the grid or as a float.
ZERO_POINTS = ("integer", "float")


class RTNWeight(NamedTuple):
    """A group-wise RTN matrix ``[out, in]``: ``ŵ = (codes − zero)·scale`` per group
    (``zero_point="integer"``, ``zero`` holds integers) or ``ŵ = codes·scale + zero``
    (``zero_point="float"``)."""

    codes: UInt8[Array, "m n"]  # unpacked digits 0..2^bits-1 (packed only on disk)
    scale: Float[Array, "m g"]
    zero: Float[Array, "m g"]
    bits: int
    group_size: int
    zero_point: str = "float"  # default of the old folders (format 1) that lack the field


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


def check_zero_point(zero_point: str) -> str:
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"zero_point={zero_point!r} is unknown; use one of {ZERO_POINTS}.")
    return zero_point


def rtn_quantize(
    weight: Float[Array, "m n"], bits: int = 4, group_size: int | None = 64,
    zero_point: str = "integer",
) -> RTNWeight:
    """Quantize ``weight [out, in]`` by group-wise asymmetric round-to-nearest.

    Args:
        weight: the matrix ``W`` with ``y = W x`` (rows = outputs).
        bits: 2, 3, 4 or 8.
        group_size: input coordinates per scale/zero pair (must divide ``in``); ``None`` = per row.
        zero_point: ``"integer"`` (standard, 0 exactly representable) or ``"float"`` (fp16 offset
            ``lo``; see the module doc for why it is much worse at 3 bits).

    Returns:
        An :class:`RTNWeight`.

    Example::

        >>> import jax.numpy as jnp
        >>> w = jnp.array([[0.0, 1.0, 2.0, 3.0]])
        >>> q = rtn_quantize(w, bits=2, group_size=4)
        >>> rtn_dequantize(q).tolist()
        [[0.0, 1.0, 2.0, 3.0]]
        >>> int(q.zero[0, 0])   # 0 is the code 0 here: lo' = min(0, 0) = 0
        0

    References:
        Frantar et al, `GPTQ <https://arxiv.org/abs/2210.17323>`_, 2022 (the RTN baseline there).
    """
    check_bits(bits)
    check_zero_point(zero_point)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {weight.shape}.")
    m, n = weight.shape
    group = check_group_size(group_size, n)
    w = weight.astype(jnp.float32).reshape(m, n // group, group)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    levels = 2**bits - 1
    if zero_point == "integer":
        lo, hi = jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)
    # the scale (and float zero) are rounded to fp16 first: what is used is what is stored
    scale = (jnp.maximum(hi - lo, 1e-8) / levels).astype(jnp.float16).astype(jnp.float32)
    if zero_point == "integer":
        zero = jnp.clip(jnp.round(-lo / scale), 0, levels)
        q = jnp.clip(jnp.round(w / scale[..., None]) + zero[..., None], 0, levels)
    else:
        zero = lo.astype(jnp.float16).astype(jnp.float32)
        q = jnp.clip(jnp.round((w - zero[..., None]) / scale[..., None]), 0, levels)
    return RTNWeight(q.reshape(m, n).astype(jnp.uint8), scale, zero, bits, group, zero_point)


def rtn_dequantize(q: RTNWeight) -> Float[Array, "m n"]:
    """Dense fp32 ``[out, in]`` from an :class:`RTNWeight`."""
    m, n = q.codes.shape
    z = q.codes.astype(jnp.float32).reshape(m, n // q.group_size, q.group_size)
    if q.zero_point == "integer":
        return ((z - q.zero[..., None]) * q.scale[..., None]).reshape(m, n)
    return (z * q.scale[..., None] + q.zero[..., None]).reshape(m, n)


def rtn_to_arrays(q: RTNWeight) -> dict:
    """Storage form: the bit-packed code stream + fp16 scale + the zero (a ``bits``-bit packed
    integer stream for ``zero_point="integer"``, fp16 for ``"float"``)."""
    if q.zero_point == "integer":
        zero = pack_bits(np.asarray(q.zero).astype(np.uint8), q.bits)
    else:
        zero = np.asarray(q.zero, np.float16)
    return {
        "codes": pack_bits(np.asarray(q.codes), q.bits),
        "scale": np.asarray(q.scale, np.float16),
        "zero": zero,
    }


def rtn_from_arrays(arrays: dict, shape: tuple[int, int], bits: int, group_size: int,
                    zero_point: str = "integer") -> RTNWeight:
    """Inverse of :func:`rtn_to_arrays` (pass the ``zero_point`` the weight was written with;
    folders of format 1 hold ``"float"``)."""
    check_zero_point(zero_point)
    m, n = shape
    codes = unpack_bits(np.asarray(arrays["codes"]), bits, m * n).reshape(m, n)
    scale = jnp.asarray(arrays["scale"], jnp.float32)
    if zero_point == "integer":
        zero = unpack_bits(np.asarray(arrays["zero"]), bits, scale.size).reshape(scale.shape)
    else:
        zero = arrays["zero"]
    return RTNWeight(jnp.asarray(codes), scale, jnp.asarray(zero, jnp.float32), bits,
                     group_size, zero_point)


__all__ = [
    "RTNWeight",
    "SUPPORTED_BITS",
    "ZERO_POINTS",
    "check_bits",
    "check_zero_point",
    "check_group_size",
    "rtn_bits_per_weight",
    "rtn_dequantize",
    "rtn_from_arrays",
    "rtn_quantize",
    "rtn_to_arrays",
]
