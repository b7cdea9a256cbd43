"""Packed storage of low-bit codes and exact bits-per-weight accounting.

Two formats:

* **lattice codes** (UniSVQ): 4 unsigned 2-bit digits per ``uint8``, first coordinate most
  significant (``idx = 64·z0 + 16·z1 + 4·z2 + z3``); optionally repacked into ``int32`` words of 16
  weights (4 codes, first code in the most significant byte).
* **bit streams** (RTN, any ``bits`` in 1..8; UniSVQ-3's 12-bit codes, up to 16): values written
  MSB-first into a ``uint8`` stream of ``ceil(N·bits/8)`` bytes, so 3-bit weights cost exactly 3
  bits.

Accounting counts every stored number: codes, scales, zeros, transforms (fp16 = 16 bits).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, UInt8

from pallas_kernels.lattice_matmul.reference import unpack_codes

FLOAT_BITS = 16  # scales, zeros, A, b are stored as fp16


def pack_codes(digits: Int[Array, "m q 4"]) -> UInt8[Array, "m q"]:
    """Pack digits ``z ∈ {0..3}`` of shape ``[m, n/4, 4]`` into ``uint8 [m, n/4]``.

    Example::

        >>> import jax.numpy as jnp
        >>> int(pack_codes(jnp.array([[[3, 2, 1, 0]]]))[0, 0])
        228
    """
    z = jnp.asarray(digits).astype(jnp.int32)
    if z.shape[-1] != 4:
        raise ValueError(f"digits last dim must be 4 (one lattice vector), got shape {z.shape}.")
    packed = (z[..., 0] << 6) | (z[..., 1] << 4) | (z[..., 2] << 2) | z[..., 3]
    return packed.astype(jnp.uint8)


def codes_to_words(codes: UInt8[Array, "m q"]) -> Int[Array, "m w"]:
    """Repack ``uint8`` codes into ``int32`` words of 4 codes (16 weights), first code highest.

    ``q`` must be a multiple of 4 (pad the codes first otherwise).
    """
    m, q = codes.shape
    if q % 4:
        raise ValueError(f"codes.shape[1]={q} must be a multiple of 4 to fill int32 words; pad it.")
    c = np.asarray(codes).astype(np.uint32).reshape(m, q // 4, 4)
    words = (c[..., 0] << 24) | (c[..., 1] << 16) | (c[..., 2] << 8) | c[..., 3]
    return jnp.asarray(words.view(np.int32))


def words_to_codes(words: Int[Array, "m w"]) -> UInt8[Array, "m q"]:
    """Inverse of :func:`codes_to_words`."""
    w = np.asarray(words).view(np.uint32)
    parts = [(w >> s) & 0xFF for s in (24, 16, 8, 0)]
    return jnp.asarray(np.stack(parts, axis=-1).reshape(w.shape[0], -1).astype(np.uint8))


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints ``< 2**bits`` (``bits`` in 1..16; any shape, C order) into a ``uint8``
    stream, MSB first.

    Example::

        >>> pack_bits(np.array([7, 0, 5]), 3).tolist()   # 111 000 101 -> 11100010 1.......
        [226, 128]
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"bits={bits} must lie in 1..16 for a bit stream.")
    dtype = np.uint8 if bits <= 8 else np.uint16
    v = np.asarray(values)
    if v.size and (int(v.min()) < 0 or int(v.max()) >= 2**bits):
        raise ValueError(f"a value in [{int(v.min())}, {int(v.max())}] does not fit in "
                         f"bits={bits} (unsigned).")
    v = v.astype(dtype).reshape(-1)
    bit_planes = (v[:, None] >> np.arange(bits - 1, -1, -1, dtype=dtype)) & 1
    return np.packbits(bit_planes.reshape(-1).astype(np.uint8))


def unpack_bits(stream: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``count`` values as ``uint8`` (``uint16`` for
    ``bits > 8``)."""
    flat = np.unpackbits(np.asarray(stream, np.uint8))[: count * bits].reshape(count, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint32)
    return (flat.astype(np.uint32) @ weights).astype(np.uint8 if bits <= 8 else np.uint16)


def unisvq_bits_per_weight(m: int, n: int, *, bits: int = 2,
                           float_bits: int = FLOAT_BITS) -> float:
    """Exact storage of a UniSVQ matrix per weight.

    .. math::
        \\mathrm{bpw} = b + 16·(m + n + 20)/(m n)

    (``b``-bit digits: ``uint8`` codes of 4 weights for ``b = 2``, a 12-bit stream padded to a
    whole byte once per matrix for ``b = 3``, a 16-bit stream for ``b = 4``; fp16 ``s_in [n]``,
    ``s_out [m]``, ``A [4,4]``, ``b [4]``; the Hadamard sign vectors are folded into
    ``s_in``/``s_out`` and the block size is a shape rule, so they cost 0.)

    Example::

        >>> round(unisvq_bits_per_weight(4096, 4096), 4)
        2.0078
        >>> round(unisvq_bits_per_weight(4096, 4096, bits=3), 4)
        3.0078
        >>> round(unisvq_bits_per_weight(4096, 4096, bits=4), 4)
        4.0078
    """
    if bits not in (2, 3, 4):
        raise ValueError(f"bits={bits!r}: UniSVQ stores 2-, 3- or 4-bit lattice digits.")
    code_bits = 8 * math.ceil(m * (n // 4) * 4 * bits / 8)
    return (code_bits + float_bits * (m + n + 20)) / (m * n)


def rtn_bits_per_weight(m: int, n: int, bits: int, group_size: int | None,
                        *, float_bits: int = FLOAT_BITS, zero_point: str = "integer") -> float:
    """Exact storage of group-wise asymmetric RTN per weight.

    ``zero_point="integer"``: ``bits + (16 + bits)/group`` (fp16 scale, ``bits``-bit zero-point,
    both bit streams padded to a whole byte once per matrix); ``"float"``: ``bits + 2·16/group``.
    ``group_size=None`` means one group per row (per-channel).

    Example::

        >>> rtn_bits_per_weight(576, 576, 3, 64)   # 3 + 19/64
        3.296875
    """
    group = n if group_size is None else group_size
    if group < 1 or n % group:
        raise ValueError(
            f"group_size={group_size} must be a positive divisor of the input dim {n}."
        )
    code_bits = 8 * math.ceil(m * n * bits / 8)
    groups = m * (n // group)
    if zero_point == "integer":
        zero_bits = 8 * math.ceil(groups * bits / 8)
    elif zero_point == "float":
        zero_bits = float_bits * groups
    else:
        raise ValueError(f"zero_point={zero_point!r} is unknown; use 'integer' or 'float'.")
    return (code_bits + float_bits * groups + zero_bits) / (m * n)


def vq_bits_per_weight(m: int, n: int, *, dim: int = 4, centroids: int = 256,
                       float_bits: int = FLOAT_BITS) -> float:
    """Unconstrained VQ: ``log2(K)/d`` bits per weight + the fp16 codebook ``K×d`` + fp16 scales
    ``s_in``/``s_out`` (same rotation wrapper as UniSVQ)."""
    return math.log2(centroids) / dim + float_bits * (centroids * dim + m + n) / (m * n)


def storage_bits(arrays: dict) -> int:
    """Bits actually held by a dict of stored arrays (floats counted as fp16)."""
    total = 0
    for value in arrays.values():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating):
            total += value.size * FLOAT_BITS
        else:
            total += value.nbytes * 8
    return total


__all__ = [
    "FLOAT_BITS",
    "codes_to_words",
    "pack_bits",
    "pack_codes",
    "rtn_bits_per_weight",
    "storage_bits",
    "unisvq_bits_per_weight",
    "unpack_bits",
    "unpack_codes",
    "vq_bits_per_weight",
    "words_to_codes",
]
