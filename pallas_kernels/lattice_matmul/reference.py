"""Pure-jnp reference for the UniSVQ lattice matmul: unpack, Hadamard rotations, fold and dequant.

Layout (shared with the kernel):

* ``codes [m, n/4]``: one code per group of 4 consecutive input coordinates of a row of the
  rotated weight, first coordinate most significant. The dtype gives the digit width
  (:func:`code_bits`): ``uint8`` holds 2-bit digits, ``idx = 64·z0 + 16·z1 + 4·z2 + z3`` with
  ``z ∈ {0,1,2,3}⁴`` (UniSVQ-2); ``uint16`` holds 3-bit digits in its low 12 bits,
  ``idx = 512·z0 + 64·z1 + 8·z2 + z3`` with ``z ∈ {0..7}⁴`` (UniSVQ-3, 4096 codewords).
  4-bit digits (UniSVQ-4, ``z ∈ {0..15}⁴``, 65536 codewords) fill a whole ``uint16``, so the
  dtype alone cannot tell 3 from 4 bits: every function here takes an explicit ``bits=`` (the
  stored weight's metadata); ``bits=None`` infers the historical default from the dtype.
* The rotated weight row ``i`` is the concatenation over groups ``g`` of the codewords
  ``A z_{i,g} + b`` (``A [4, 4]``, ``b [4]``).
* The full weight is ``W = diag(s_out) · Hmᵀ · C · Hn · diag(s_in)`` where ``Hm``, ``Hn`` are
  block-diagonal orthonormal Hadamard matrices.

Nothing here depends on ``lowrank_jax``: the quantizer imports these helpers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt

GROUP = 4  # lattice dimension d: 4 weights per code
CODE_BITS = {np.dtype(np.uint8): 2, np.dtype(np.uint16): 3}  # dtype -> default bits per digit
LATTICE_DIGIT_BITS = (2, 3, 4)  # supported digit widths ({0..3}⁴, {0..7}⁴, {0..15}⁴)


def code_bits(codes, bits: int | None = None) -> int:
    """Bits per lattice digit of a code array.

    With ``bits=None`` the dtype gives the historical default (2 for ``uint8``, 3 for
    ``uint16``); an explicit ``bits`` (2, 3 or 4) is checked to fit 4 digits in the dtype.

    Example::

        >>> import jax.numpy as jnp
        >>> code_bits(jnp.zeros((1, 1), jnp.uint8)), code_bits(jnp.zeros((1, 1), jnp.uint16))
        (2, 3)
        >>> code_bits(jnp.zeros((1, 1), jnp.uint16), bits=4)
        4
    """
    dtype = np.dtype(codes.dtype)
    if bits is None:
        bits = CODE_BITS.get(dtype)
        if bits is None:
            raise ValueError(
                f"lattice codes have dtype {codes.dtype}; use uint8 (2-bit digits, 4 per byte) or "
                "uint16 (3- or 4-bit digits, 12 or 16 bits per code)."
            )
        return bits
    if bits not in LATTICE_DIGIT_BITS:
        raise ValueError(f"bits={bits!r}: lattice digits are {LATTICE_DIGIT_BITS} bits wide.")
    if not np.issubdtype(dtype, np.unsignedinteger) or 8 * dtype.itemsize < GROUP * bits:
        raise ValueError(
            f"lattice codes of dtype {codes.dtype} cannot hold 4 digits of bits={bits}; use "
            f"{'uint8' if bits == 2 else 'uint16'}."
        )
    return bits


def unpack_planes(codes: UInt[Array, "m q"], bits: int | None = None) -> list[Array]:
    """The 4 digit planes ``z_j = (codes >> (b·(3 - j))) & (2^b − 1)`` as ``int32 [m, n/4]`` each,
    ``b = code_bits(codes, bits)``.

    Example::

        >>> import jax.numpy as jnp
        >>> [int(p[0, 0]) for p in unpack_planes(jnp.array([[0b11100100]], jnp.uint8))]
        [3, 2, 1, 0]
        >>> [int(p[0, 0]) for p in unpack_planes(jnp.array([[0o7250]], jnp.uint16))]
        [7, 2, 5, 0]
    """
    bits = code_bits(codes, bits)
    c = codes.astype(jnp.int32)
    return [(c >> (bits * (GROUP - 1 - j))) & ((1 << bits) - 1) for j in range(GROUP)]


def unpack_codes(codes: UInt[Array, "m q"], bits: int | None = None) -> Float[Array, "m q 4"]:
    """Digits ``z [m, n/4, 4]`` (int32) of packed codes, first coordinate most significant."""
    return jnp.stack(unpack_planes(codes, bits), axis=-1)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(size: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix ``H`` (``H Hᵀ = I``) of a power-of-two ``size``.

    Example::

        >>> h = hadamard_matrix(4)
        >>> bool(np.allclose(h @ h.T, np.eye(4)))
        True
    """
    if size < 1 or size & (size - 1):
        raise ValueError(f"hadamard size={size} must be a power of two; pick a block that is.")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(size)).astype(np.float32)


def hadamard_block_size(dim: int, max_block: int = 128) -> int:
    """Largest power of two ``≤ max_block`` that divides ``dim`` (DERIVED: the spec's block128
    Hadamard needs ``128 | dim``; SmolLM2's 576/192 are not, so we fall back to 64).

    Example::

        >>> hadamard_block_size(576), hadamard_block_size(1536), hadamard_block_size(192)
        (64, 128, 64)
    """
    if dim < 1:
        raise ValueError(f"dim={dim} must be positive.")
    block = 1
    while block * 2 <= max_block and dim % (block * 2) == 0:
        block *= 2
    return block


def block_hadamard(x: Float[Array, "... n"], block: int, *, transpose: bool = False) -> Array:
    """Apply ``I_{n/block} ⊗ H_block`` (or its transpose) to the last axis of ``x``.

    ``H`` is symmetric for Sylvester matrices, so ``transpose`` changes nothing numerically but
    documents which side of the identity is meant.
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not divisible by hadamard block={block}.")
    h = jnp.asarray(hadamard_matrix(block), dtype=jnp.float32)
    if transpose:
        h = h.T
    xs = x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)
    return jnp.einsum("...gj,kj->...gk", xs, h).reshape(x.shape).astype(x.dtype)


def decode_codes(
    codes: UInt[Array, "m q"], affine: Float[Array, "4 4"], offset: Float[Array, "4"],
    bits: int | None = None,
) -> Float[Array, "m n"]:
    """Rotated-domain weight ``C [m, n]`` with ``C[i, 4g:4g+4] = A z_{i,g} + b`` (fp32)."""
    z = unpack_codes(codes, bits).astype(jnp.float32)  # m q 4
    c = jnp.einsum("mqk,jk->mqj", z, affine.astype(jnp.float32)) + offset.astype(jnp.float32)
    return c.reshape(codes.shape[0], codes.shape[1] * GROUP)


def fold_activations(
    x_rot: Float[Array, "t n"], affine: Float[Array, "4 4"], offset: Float[Array, "4"]
) -> tuple[Array, Array]:
    """Fold the affine map onto the activations.

    .. math::
        (C x)_i = \\sum_g z_{i,g}·(Aᵀ x_g) + bᵀ \\sum_g x_g

    Returns ``(x_planes [4, t, n/4], correction [t])`` with ``x_planes[k, :, g] = (Aᵀ x_g)_k``
    (planar layout, so the kernel never interleaves) and ``correction = bᵀ Σ_g x_g``.
    """
    t, n = x_rot.shape
    xg = x_rot.astype(jnp.float32).reshape(t, n // GROUP, GROUP)  # t q j
    planes = jnp.einsum("tqj,jk->ktq", xg, affine.astype(jnp.float32))
    correction = jnp.einsum("tqj,j->t", xg, offset.astype(jnp.float32))
    return planes, correction


def code_matmul_reference(
    x_rot: Float[Array, "t n"],
    codes: UInt[Array, "m q"],
    affine: Float[Array, "4 4"],
    offset: Float[Array, "4"],
    bits: int | None = None,
) -> Float[Array, "t m"]:
    """``x_rot @ Cᵀ`` in the rotated domain, by decoding ``C`` densely (fp32 accumulate)."""
    c = decode_codes(codes, affine, offset, bits)
    return jnp.dot(x_rot.astype(jnp.float32), c.T, precision=jax.lax.Precision.HIGHEST)


def planes_matmul_reference(
    x_planes: Float[Array, "4 t q"], codes: UInt[Array, "m q"], bits: int | None = None
) -> Float[Array, "t m"]:
    """The integer part of fold mode: ``Σ_k x_planes[k] @ z_kᵀ`` (what the fold kernel computes)."""
    out = 0.0
    for k, z in enumerate(unpack_planes(codes, bits)):
        out = out + jnp.dot(
            x_planes[k].astype(jnp.float32), z.astype(jnp.float32).T,
            precision=jax.lax.Precision.HIGHEST,
        )
    return out


def dequantize_reference(
    codes: UInt[Array, "m q"],
    scale_in: Float[Array, " n"],
    scale_out: Float[Array, " m"],
    affine: Float[Array, "4 4"],
    offset: Float[Array, "4"],
    *,
    block_in: int,
    block_out: int,
    bits: int | None = None,
) -> Float[Array, "m n"]:
    """Dense weight ``W = diag(s_out) Hmᵀ C Hn diag(s_in)`` ([out, in], fp32)."""
    c = decode_codes(codes, affine, offset, bits)
    c = block_hadamard(c, block_in)  # C Hn  (H symmetric)
    c = block_hadamard(c.T, block_out, transpose=True).T  # Hmᵀ C Hn
    return scale_out[:, None].astype(jnp.float32) * c * scale_in[None, :].astype(jnp.float32)


def lattice_matmul_reference(
    x: Float[Array, "... n"],
    codes: UInt[Array, "m q"],
    scale_in: Float[Array, " n"],
    scale_out: Float[Array, " m"],
    affine: Float[Array, "4 4"],
    offset: Float[Array, "4"],
    *,
    block_in: int,
    block_out: int,
    bits: int | None = None,
) -> Float[Array, "... m"]:
    """``y = x @ Wᵀ`` with the dense dequantized weight (the ground truth of every mode)."""
    w = dequantize_reference(
        codes, scale_in, scale_out, affine, offset, block_in=block_in, block_out=block_out,
        bits=bits,
    )
    y = jnp.einsum("...n,mn->...m", x.astype(jnp.float32), w,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


__all__ = [
    "CODE_BITS",
    "GROUP",
    "LATTICE_DIGIT_BITS",
    "code_bits",
    "block_hadamard",
    "code_matmul_reference",
    "decode_codes",
    "dequantize_reference",
    "fold_activations",
    "hadamard_block_size",
    "hadamard_matrix",
    "lattice_matmul_reference",
    "planes_matmul_reference",
    "unpack_codes",
    "unpack_planes",
]
