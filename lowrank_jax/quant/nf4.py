"""NF4 (4-bit NormalFloat) quantization exactly as QLoRA defines it, and :class:`NF4Linear`.

NF4 has 16 levels: the quantiles of a standard normal, normalised to ``[-1, 1]``, built
asymmetrically so that 0 is exact (8 positive levels, 7 negative, and 0):

.. math::
    q^+_i = \\Phi^{-1}(\\delta_i),\\ \\delta = \\mathrm{linspace}(0.9677, 0.5, 9)_{0..7},\\quad
    q^-_j = -\\Phi^{-1}(\\mathrm{linspace}(0.9677, 0.5, 8)_{0..6}),\\quad
    \\mathrm{NF4} = \\mathrm{sort}(q^-, 0, q^+) / \\max|q|

A weight ``W [out, in]`` is cut into blocks of ``block_size = 64`` consecutive input coordinates
(row-major, as bitsandbytes flattens a torch ``[out, in]`` weight); each block stores its absmax
``c`` and ``ŵ = c · NF4[code]`` with ``code = argmin_k |w / c - NF4_k|``: 4 + 32/64 = 4.5 bits per
weight. **Double quantization** (QLoRA §3) quantizes the fp32 absmaxes again: minus their mean,
in blocks of 256, to 8 bits (here a symmetric linear int8 grid with one fp32 scale per block —
bitsandbytes uses its dynamic 8-bit float map there), giving ``4 + 8/64 + 32/(64·256) ≈ 4.127``.

References:
    Dettmers et al, `QLoRA: Efficient Finetuning of Quantized LLMs
    <https://arxiv.org/abs/2305.14314>`_, 2023 (Appendix E: the NF4 construction).
"""

from __future__ import annotations

from statistics import NormalDist
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from lowrank_jax.nn.projection import register_projection
from lowrank_jax.quant.layers import QuantCodes, QuantScale

NF4_OFFSET = 0.9677083  # QLoRA's offset: (1 - 1/(2·15) + 1 - 1/(2·16)) / 2
NF4_BLOCK = 64
DQ_BLOCK = 256


def nf4_levels() -> Float[Array, "16"]:
    """The 16 NF4 levels, computed from QLoRA's definition (ascending, ``-1 ... 0 ... 1``).

    Example::

        >>> levels = nf4_levels()
        >>> float(levels[0]), float(levels[7]), float(levels[15])
        (-1.0, 0.0, 1.0)
    """
    return jnp.asarray(_LEVELS)


def _levels() -> np.ndarray:
    # on the host in float64, as QLoRA builds its table with scipy's norm.ppf (the standard
    # library's inverse CDF gives the same float32 table, without scipy.stats' 1 s import): the
    # ends are exactly -1 and 1 whatever XLA's optimisation flags
    ppf = NormalDist().inv_cdf
    pos = np.array([ppf(p) for p in np.linspace(NF4_OFFSET, 0.5, 9)[:-1]])
    neg = -np.array([ppf(p) for p in np.linspace(NF4_OFFSET, 0.5, 8)[:-1]])
    v = np.sort(np.concatenate([pos, np.zeros(1), neg]))
    return (v / np.max(np.abs(v))).astype(np.float32)


_LEVELS = _levels()


class NF4Weight(NamedTuple):
    """An NF4 matrix ``[out, in]``: two 4-bit codes per byte, one absmax per 64-block.

    Without double quantization ``absmax`` is the fp32 ``[out, in/64]`` absmax and
    ``absmax_scale`` / ``absmax_offset`` are ``None``; with it ``absmax`` holds int8 codes and
    ``absmax_scale [n_blocks/256]``, ``absmax_offset []`` recover it.
    """

    packed: Array  # uint8 [out, in/2]: code of column 2j in the high nibble, 2j+1 in the low
    absmax: Array
    absmax_scale: Array | None
    absmax_offset: Array | None
    block_size: int


def _check_shape(weight, block_size: int) -> None:
    if weight.ndim != 2:
        raise ValueError(f"nf4_quantize: weight must be 2-D [out, in], got shape {weight.shape}.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
            or block_size % 2:
        raise ValueError(f"nf4_quantize: block_size={block_size!r} must be an even int >= 2 "
                         "(QLoRA uses 64).")
    if weight.shape[1] % block_size:
        raise ValueError(
            f"nf4_quantize: the input dim {weight.shape[1]} of weight {weight.shape} is not "
            f"divisible by block_size={block_size}; pick a block size that divides it.")


def _quantize_absmax(absmax: Array) -> tuple[Array, Array, Array]:
    flat = absmax.reshape(-1)
    offset = jnp.mean(flat)
    centred = flat - offset
    pad = (-flat.size) % DQ_BLOCK
    blocks = jnp.pad(centred, (0, pad)).reshape(-1, DQ_BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=1), 1e-12) / 127.0
    q = jnp.clip(jnp.round(blocks / scale[:, None]), -127, 127).astype(jnp.int8)
    return q.reshape(-1)[: flat.size].reshape(absmax.shape), scale, offset


def nf4_absmax(w: NF4Weight) -> Float[Array, "m g"]:
    """The per-block absmax (dequantized from int8 when double-quantized)."""
    if w.absmax_scale is None:
        return w.absmax
    flat = w.absmax.reshape(-1).astype(jnp.float32)
    pad = (-flat.size) % DQ_BLOCK
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, DQ_BLOCK) * w.absmax_scale[:, None]
    return (blocks.reshape(-1)[: flat.size] + w.absmax_offset).reshape(w.absmax.shape)


def nf4_quantize(weight: Float[Array, "m n"], block_size: int = NF4_BLOCK, *,
                 double_quant: bool = False) -> NF4Weight:
    """Blockwise NF4 of ``weight [out, in]`` (absmax per ``block_size`` inputs).

    Example::

        >>> import jax.numpy as jnp
        >>> w = jnp.array([[1.0, -1.0, 0.0, 0.5]])
        >>> nf4_codes(nf4_quantize(w, block_size=4)).tolist()
        [[15, 0, 7, 12]]
    """
    _check_shape(weight, block_size)
    m, n = weight.shape
    w = jnp.asarray(weight, jnp.float32).reshape(m, n // block_size, block_size)
    absmax = jnp.max(jnp.abs(w), axis=-1)
    safe = jnp.where(absmax > 0, absmax, 1.0)
    normed = w / safe[..., None]
    codes = jnp.argmin(jnp.abs(normed[..., None] - nf4_levels()), axis=-1).astype(jnp.uint8)
    codes = codes.reshape(m, n)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    if not double_quant:
        return NF4Weight(packed, absmax, None, None, block_size)
    q, scale, offset = _quantize_absmax(absmax)
    return NF4Weight(packed, q, scale, offset, block_size)


def nf4_codes(w: NF4Weight) -> Array:
    """Unpacked codes ``uint8 [out, in]`` (values 0..15)."""
    hi, lo = w.packed >> 4, w.packed & 15
    return jnp.stack([hi, lo], axis=-1).reshape(w.packed.shape[0], -1)


def nf4_dequantize(w: NF4Weight) -> Float[Array, "m n"]:
    """Dense fp32 ``[out, in]``: ``absmax · NF4[code]`` blockwise."""
    codes = nf4_codes(w)
    m, n = codes.shape
    values = nf4_levels()[codes].reshape(m, n // w.block_size, w.block_size)
    return (values * nf4_absmax(w)[..., None]).reshape(m, n)


def nf4_bits_per_weight(w: NF4Weight) -> float:
    """Stored bits per weight: 4 + absmax bits / block (≈4.5; ≈4.127 double-quantized)."""
    m, n = w.packed.shape[0], 2 * w.packed.shape[1]
    bits = 4.0 * m * n
    if w.absmax_scale is None:
        bits += 32.0 * w.absmax.size
    else:
        bits += 8.0 * w.absmax.size + 32.0 * w.absmax_scale.size + 32.0
    return bits / (m * n)


class NF4Linear(nnx.Module):
    """A bias-free frozen NF4 projection ``y = x Ŵᵀ``, dequantized on the fly (QLoRA's base).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
        >>> NF4Linear(nf4_quantize(w))(jnp.ones((2, 64))).shape
        (2, 8)
    """

    def __init__(self, weight: NF4Weight):
        self.out_features = int(weight.packed.shape[0])
        self.in_features = int(2 * weight.packed.shape[1])
        self.block_size = int(weight.block_size)
        self.double_quant = weight.absmax_scale is not None
        self.packed = QuantCodes(jnp.asarray(weight.packed, jnp.uint8))
        if self.double_quant:
            self.absmax = QuantCodes(jnp.asarray(weight.absmax, jnp.int8))
            self.absmax_scale = QuantScale(jnp.asarray(weight.absmax_scale, jnp.float32))
            self.absmax_offset = QuantScale(jnp.asarray(weight.absmax_offset, jnp.float32))
        else:
            self.absmax = QuantScale(jnp.asarray(weight.absmax, jnp.float32))
            self.absmax_scale = nnx.data(None)
            self.absmax_offset = nnx.data(None)

    def weight(self) -> NF4Weight:
        scale = None if self.absmax_scale is None else self.absmax_scale[...]
        offset = None if self.absmax_offset is None else self.absmax_offset[...]
        return NF4Weight(self.packed[...], self.absmax[...], scale, offset, self.block_size)

    def bits_per_weight(self) -> float:
        return nf4_bits_per_weight(self.weight())

    def __call__(self, x: Float[Array, "... n"]) -> Float[Array, "... m"]:
        w = nf4_dequantize(self.weight())
        return jnp.einsum("...n,mn->...m", x.astype(jnp.float32), w).astype(x.dtype)


def _nf4_requantize(layer: NF4Linear, matrix) -> NF4Linear:
    return NF4Linear(nf4_quantize(jnp.asarray(matrix, jnp.float32).T, layer.block_size,
                                  double_quant=layer.double_quant))


# a projection of the protocol (lowrank_jax.nn.projection): adaptable, mergeable, re-quantizable
register_projection(NF4Linear, kernel=None, equation="...i,io->...o",
                    shape=lambda m: (m.in_features, m.out_features),
                    dense=lambda m: nf4_dequantize(m.weight()).T, requantize=_nf4_requantize,
                    method="nf4")

__all__ = ["NF4Linear", "NF4Weight", "NF4_BLOCK", "nf4_bits_per_weight", "nf4_codes",
           "nf4_dequantize", "nf4_levels", "nf4_quantize"]
