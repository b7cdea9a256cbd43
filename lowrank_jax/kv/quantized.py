"""KIVI-style quantized KV cache: keys per channel, values per token, a full-precision window.

Asymmetric ``b``-bit quantization of a group ``x_G`` of numbers:

.. math::

    s = \\frac{\\max x_G - \\min x_G}{2^b - 1},\\qquad
    q = \\mathrm{round}\\Big(\\frac{x - \\min x_G}{s}\\Big) \\in \\{0, \\dots, 2^b - 1\\},\\qquad
    \\hat x = \\min x_G + s\\,q.

KIVI groups **keys per channel** (a group is ``group_size`` consecutive tokens of one channel:
keys have outlier channels, so the range is set per channel) and **values per token** (a group
is ``group_size`` consecutive channels of one token). The most recent prompt tokens (the
residual window) stay in full precision, and optionally the first ``S`` (attention sinks). The
codes are bit-packed into ``uint8`` (four 2-bit or two 4-bit codes per byte); the scale and
minimum of each group are stored in the cache's float dtype (fp16 by default), so
:func:`stored_bytes` of a :class:`KIVICache` is exactly the bytes of the arrays it holds.

References:
    Liu et al, `KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache
    <https://arxiv.org/abs/2402.02750>`_, 2024.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

KV_BITS = (1, 2, 4, 8)
KV_DEFAULT_BITS = 2
KV_GROUP_SIZE = 32  # KIVI's default group size
DEFAULT_RESIDUAL = 128  # KIVI's default full-precision window of recent tokens
STORAGE_DTYPE = "float16"  # exact tokens, scales, minima: the deployed 16-bit cache


def check_kv_bits(bits) -> int:
    """``bits`` as an int; ``ValueError`` unless it is one of ``KV_BITS`` (uint8 packing)."""
    if bits not in KV_BITS or isinstance(bits, bool):
        raise ValueError(f"bits={bits!r} must be one of {KV_BITS} (codes are packed into "
                         "uint8); use 2 or 4 for a KIVI cache.")
    return int(bits)


def pack_kv_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Pack integer codes in ``[0, 2^bits)`` into a flat ``uint8`` array (``8 // bits`` per
    byte, zero-padded at the end).

    Example::

        >>> import jax.numpy as jnp
        >>> pack_kv_codes(jnp.asarray([1, 2, 3, 0, 3], jnp.uint8), 2).tolist()
        [57, 3]
    """
    bits = check_kv_bits(bits)
    per = 8 // bits
    flat = codes.reshape(-1).astype(jnp.uint8)
    pad = (-flat.size) % per
    flat = jnp.pad(flat, (0, pad)).reshape(-1, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return jnp.sum(flat << shifts, axis=1, dtype=jnp.uint32).astype(jnp.uint8)


def unpack_kv_codes(packed: jax.Array, bits: int, size: int) -> jax.Array:
    """Inverse of :func:`pack_kv_codes`: the first ``size`` codes as ``uint8``."""
    bits = check_kv_bits(bits)
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    codes = (packed[:, None] >> shifts) & jnp.uint8((1 << bits) - 1)
    return codes.reshape(-1)[:size]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale", "minimum"],
                   meta_fields=["shape", "bits", "axis", "group_size"])
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A ``bits``-bit group-quantized array (a pytree).

    Attributes:
        codes: packed ``uint8`` codes of every element (row-major order of ``shape``).
        scale, minimum: per group, ``shape`` with ``shape[axis]`` replaced by
            ``(shape[axis] // group_size, 1)``.
        shape: the original shape; ``axis`` the grouped axis; ``group_size`` its group length.
    """

    codes: Array
    scale: Array
    minimum: Array
    shape: tuple
    bits: int
    axis: int
    group_size: int


def quantize(x: Float[Array, "..."], bits: int, *, axis: int, group_size: int,
             dtype=STORAGE_DTYPE, search_clip: bool = False) -> QuantizedArray:
    """Asymmetric min/max quantization in groups of ``group_size`` along ``axis``.

    The scale and minimum are rounded to ``dtype`` first and the codes are computed against
    the rounded values, so :func:`dequantize_kv` is within half a step of ``x`` (plus the
    ``dtype`` rounding of the minimum). A group with at most ``2^bits`` equally spaced levels
    is reproduced exactly.

    Args:
        x: the array.
        bits: 2, 4 or 8.
        axis: the axis the groups run along.
        group_size: numbers per group; when it does not divide ``x.shape[axis]`` the axis is
            padded with its last entry to a multiple (the padding is not stored as codes of
            its own: it only fills the last group).
        dtype: storage dtype of the scale and minimum.
        search_clip: instead of the group's min/max, use the range ``mid ± c·half`` (values
            outside clipped) with ``c`` in ``CLIP_GRID`` that gives each group the smallest
            squared error (the MSE-optimal range of a bell-shaped group at 1–2 bits is ~30–55 %
            of its min/max range). Same stored format; :func:`dequantize_kv` is unchanged.

    Returns:
        A :class:`QuantizedArray`.

    Example::

        >>> import jax.numpy as jnp
        >>> q = quantize(jnp.asarray([[0., 1., 2., 3.]]), 2, axis=1, group_size=4)
        >>> dequantize_kv(q).tolist()
        [[0.0, 1.0, 2.0, 3.0]]
    """
    bits = check_kv_bits(bits)
    axis = axis % x.ndim
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (axis {axis} of "
                         f"shape {x.shape}).")
    return _quantize(x, bits, axis, int(group_size), jnp.dtype(dtype), bool(search_clip))


CLIP_GRID = tuple(round(1.0 - 0.1 * i, 1) for i in range(9))  # 1.0 .. 0.2 of the range


def _group_codes(grouped, lo, hi, bits: int, dtype, axis: int):
    """Codes, fp16-rounded minimum and scale of groups against the range ``[lo, hi]``."""
    levels = (1 << bits) - 1
    lo = lo.astype(dtype)
    scale = ((hi - lo.astype(jnp.float32)) / levels).astype(dtype)
    s32 = scale.astype(jnp.float32)
    safe = jnp.where(s32 > 0, s32, 1.0)
    codes = jnp.clip(jnp.round((grouped - lo.astype(jnp.float32)) / safe), 0, levels)
    return codes, lo, scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize(x, bits: int, axis: int, group_size: int, dtype,
              search_clip: bool = False) -> QuantizedArray:
    # one compiled program per (shape, bits, axis, group): op-by-op dispatch of the packing
    # used to compile a dozen small programs per call (most of an evaluation's time)
    n = x.shape[axis]
    groups = -(-n // group_size)
    padded = jnp.pad(x.astype(jnp.float32),
                     [(0, groups * group_size - n if i == axis else 0) for i in range(x.ndim)],
                     mode="edge")
    grouped = padded.reshape(x.shape[:axis] + (groups, group_size) + x.shape[axis + 1:])
    lo = grouped.min(axis=axis + 1, keepdims=True)
    hi = grouped.max(axis=axis + 1, keepdims=True)
    codes, lo16, scale = _group_codes(grouped, lo, hi, bits, dtype, axis)
    if search_clip:  # per group, the clipped range with the smallest squared error
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        error = lambda c, m, s: jnp.sum(  # noqa: E731
            (m.astype(jnp.float32) + s.astype(jnp.float32) * c - grouped) ** 2,
            axis=axis + 1, keepdims=True)
        best = error(codes, lo16, scale)
        for clip in CLIP_GRID[1:]:
            c2, m2, s2 = _group_codes(grouped, mid - clip * half, mid + clip * half, bits,
                                      dtype, axis)
            e2 = error(c2, m2, s2)
            better = e2 < best
            codes = jnp.where(better, c2, codes)
            lo16, scale = jnp.where(better, m2, lo16), jnp.where(better, s2, scale)
            best = jnp.minimum(e2, best)
    codes = jax.lax.slice_in_dim(codes.reshape(padded.shape), 0, n, axis=axis)
    return QuantizedArray(codes=pack_kv_codes(codes.astype(jnp.uint8), bits), scale=scale,
                          minimum=lo16, shape=tuple(x.shape), bits=bits, axis=axis,
                          group_size=int(group_size))


@jax.jit
def dequantize_kv(q: QuantizedArray) -> Float[Array, "..."]:
    """The fp32 array a :class:`QuantizedArray` stands for (jitted)."""
    n, axis, size = q.shape[q.axis], q.axis, q.group_size
    groups = -(-n // size)
    codes = unpack_kv_codes(q.codes, q.bits, math.prod(q.shape)).reshape(q.shape)
    codes = jnp.pad(codes, [(0, groups * size - n if i == axis else 0)
                            for i in range(len(q.shape))])
    grouped = codes.reshape(q.shape[:axis] + (groups, size) + q.shape[axis + 1:])
    x = q.minimum.astype(jnp.float32) + q.scale.astype(jnp.float32) * grouped.astype(jnp.float32)
    padded_shape = q.shape[:axis] + (groups * size,) + q.shape[axis + 1:]
    return jax.lax.slice_in_dim(x.reshape(padded_shape), 0, n, axis=axis)


def quantized_nbytes(numel: int, bits: int, groups: int, dtype=STORAGE_DTYPE) -> int:
    """Bytes of a :class:`QuantizedArray` of ``numel`` numbers in ``groups`` groups."""
    per = 8 // bits
    return -(-numel // per) + 2 * groups * jnp.dtype(dtype).itemsize


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["keys", "values", "sink_keys", "sink_values", "residual_keys",
                 "residual_values"],
    meta_fields=["prefill_length", "rope_theta"],
)
@dataclasses.dataclass(frozen=True)
class KIVICache:
    """A KIVI-quantized prompt cache (a pytree): ``[sinks | quantized | residual window]``.

    Attributes:
        keys: :class:`QuantizedArray` of the pre-RoPE keys ``[layers, b, Q, hk, d]`` grouped
            along tokens (per channel); ``None`` when no token is quantized.
        values: :class:`QuantizedArray` of the values, grouped along channels (per token).
        sink_keys, sink_values: the first ``S`` tokens, exact ``[layers, b, S, hk, d]``.
        residual_keys, residual_values: the last ``R`` prompt tokens, exact.
        prefill_length: ``L = S + Q + R``; rope_theta: RoPE base (static).
    """

    keys: QuantizedArray | None
    values: QuantizedArray | None
    sink_keys: Array
    sink_values: Array
    residual_keys: Array
    residual_values: Array
    prefill_length: int
    rope_theta: float

    @property
    def n_layers(self) -> int:
        return self.sink_keys.shape[0]

    @property
    def bits(self) -> int | None:
        return None if self.keys is None else self.keys.bits


def _layout(tokens: int, sink_tokens: int, residual: int, group_size: int) -> tuple[int, int]:
    """``(quantized, residual)`` token counts: the quantized span is a multiple of the group."""
    quantized = max(0, (tokens - sink_tokens - residual) // group_size * group_size)
    return quantized, tokens - sink_tokens - quantized


def kivi_compress(
    keys: Float[Array, "layers b L hk d"], values: Float[Array, "layers b L hk d"], *,
    rope_theta: float, bits: int = KV_DEFAULT_BITS, group_size: int = KV_GROUP_SIZE,
    residual: int = DEFAULT_RESIDUAL, sink_tokens: int = 0, dtype=STORAGE_DTYPE,
) -> KIVICache:
    """Quantize a prefilled cache KIVI-style.

    Args:
        keys, values: pre-RoPE keys and values ``[layers, b, L, hk, d]``.
        rope_theta: RoPE base (kept for decoding).
        bits: 2, 4 or 8.
        group_size: tokens per key group (per channel) and channels per value group
            (per token; capped at ``d``).
        residual: at least this many most recent prompt tokens stay exact (up to
            ``group_size − 1`` more so that the quantized span is a multiple of the group).
        sink_tokens: leading prompt tokens kept exact (0 in the paper).
        dtype: float dtype of the exact tokens, scales and minima.

    Returns:
        A :class:`KIVICache`.

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (2, 1, 40, 1, 8))
        >>> cache = kivi_compress(k, k, rope_theta=1e4, bits=2, group_size=8, residual=8)
        >>> cache.keys.shape, cache.residual_keys.shape[2]
        ((2, 1, 32, 1, 8), 8)
    """
    if keys.ndim != 5 or keys.shape != values.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} must both be "
                         "[layers, batch, tokens, kv_heads, head_dim].")
    check_kv_bits(bits)
    length, d = keys.shape[2], keys.shape[-1]
    for name, value in (("residual", residual), ("sink_tokens", sink_tokens)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0.")
    if not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (KIVI uses 32).")
    value_group = min(int(group_size), d)
    if d % value_group:
        raise ValueError(f"group_size={group_size} must divide head_dim={d} (value groups run "
                         "along channels) or be >= it.")
    if sink_tokens >= length:
        raise ValueError(f"sink_tokens={sink_tokens} must be < the prompt length {length}.")
    quantized, kept = _layout(length, sink_tokens, residual, group_size)
    dt = jnp.dtype(dtype)
    body = slice(sink_tokens, sink_tokens + quantized)
    qk = qv = None
    if quantized:
        qk = quantize(keys[:, :, body], bits, axis=2, group_size=int(group_size), dtype=dt)
        qv = quantize(values[:, :, body], bits, axis=4, group_size=value_group, dtype=dt)
    tail = slice(sink_tokens + quantized, length)
    return KIVICache(
        keys=qk, values=qv, sink_keys=keys[:, :, :sink_tokens].astype(dt),
        sink_values=values[:, :, :sink_tokens].astype(dt),
        residual_keys=keys[:, :, tail].astype(dt), residual_values=values[:, :, tail].astype(dt),
        prefill_length=int(length), rope_theta=float(rope_theta),
    )


def kivi_reconstruct(cache: KIVICache, layer: int | None = None, kind: str = "k"):
    """Dense fp32 pre-RoPE keys (``"k"``) or values (``"v"``) of the prompt, one layer
    ``[b, L, hk, d]`` or every layer (``layer=None``)."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind={kind!r} must be 'k' or 'v'.")
    sink, q, rest = ((cache.sink_keys, cache.keys, cache.residual_keys) if kind == "k" else
                     (cache.sink_values, cache.values, cache.residual_values))
    parts = [sink.astype(jnp.float32)]
    if q is not None:
        parts.append(dequantize_kv(q))
    parts.append(rest.astype(jnp.float32))
    full = jnp.concatenate(parts, axis=2)
    return full if layer is None else full[layer]


def kivi_stored_bytes(*, n_layers: int, batch: int, tokens: int, kv_heads: int, head_dim: int,
                      bits: int, group_size: int, residual: int, sink_tokens: int = 0,
                      dtype=STORAGE_DTYPE) -> int:
    """Bytes :func:`kivi_compress` stores for these settings (without building the cache)."""
    quantized, kept = _layout(tokens, sink_tokens, residual, group_size)
    item = jnp.dtype(dtype).itemsize
    rows = n_layers * batch * kv_heads
    exact = 2 * rows * (sink_tokens + kept) * head_dim * item
    if not quantized:
        return exact
    numel = rows * quantized * head_dim
    key_groups = rows * (quantized // group_size) * head_dim
    value_groups = rows * quantized * (head_dim // min(group_size, head_dim))
    return (exact + quantized_nbytes(numel, bits, key_groups, dtype)
            + quantized_nbytes(numel, bits, value_groups, dtype))


def choose_kivi_settings(ratio: float, *, n_layers: int, batch: int, tokens: int, kv_heads: int,
                         head_dim: int, sink_tokens: int = 0, max_residual: int = DEFAULT_RESIDUAL,
                         dtype=STORAGE_DTYPE) -> dict:
    """The most precise KIVI setting whose stored bytes meet ``ratio`` against the exact
    ``dtype`` cache.

    Tries bits 8, 4, 2 (in that order) and, for each, group sizes 32, 64, 128; the first pair
    that meets the ratio gets the largest residual window ``<= max_residual`` that still meets
    it.

    Returns:
        ``dict(bits=, group_size=, residual=)``.

    Example::

        >>> choose_kivi_settings(4.0, n_layers=30, batch=1, tokens=1024, kv_heads=3,
        ...                      head_dim=64)
        {'bits': 2, 'group_size': 32, 'residual': 64}
    """
    if not ratio > 0 or not math.isfinite(ratio):
        raise ValueError(f"ratio={ratio!r} must be a finite number > 0 (e.g. 4).")
    common = dict(n_layers=n_layers, batch=batch, tokens=tokens, kv_heads=kv_heads,
                  head_dim=head_dim, sink_tokens=sink_tokens, dtype=dtype)
    reference = 2 * n_layers * batch * tokens * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    budget = reference / ratio
    best = 0.0
    for bits in (8, 4, 2):
        for group in (32, 64, 128):
            if head_dim % min(group, head_dim):
                continue
            best = max(best, reference / kivi_stored_bytes(bits=bits, group_size=group,
                                                           residual=0, **common))
            for residual in range(min(max_residual, tokens - sink_tokens), -1, -1):
                if kivi_stored_bytes(bits=bits, group_size=group, residual=residual,
                                     **common) <= budget:
                    return dict(bits=bits, group_size=group, residual=residual)
    raise ValueError(
        f"ratio={ratio} is out of reach of a KIVI cache at {tokens} tokens and head_dim "
        f"{head_dim}: its most compact setting (2 bits, groups of 128, no residual window) "
        f"reaches {best:.2f}x. Lower the ratio or use a low-rank method (e.g. 'xkv_quant')."
    )


__all__ = [
    "KV_DEFAULT_BITS", "KV_GROUP_SIZE", "DEFAULT_RESIDUAL", "KIVICache", "QuantizedArray",
    "STORAGE_DTYPE", "KV_BITS", "check_kv_bits", "choose_kivi_settings", "dequantize_kv",
    "kivi_compress",
    "kivi_reconstruct", "kivi_stored_bytes", "pack_kv_codes", "quantize", "quantized_nbytes",
    "unpack_kv_codes",
]
