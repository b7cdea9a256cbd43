"""xKV with quantized factors: more rank per byte, ranks allocated by spectrum energy.

A rank-``r`` xKV group stores a token factor ``A [L, r]`` and per-layer bases ``B [H_kv, r, D]``.
Stored at ``b_A`` and ``b_B`` bits instead of 16, the same bytes hold roughly
``16 / b`` times the rank (a rank-``2r`` factor at 8 bits costs what a rank-``r`` factor costs at
16). ``A`` is quantized per rank channel in token groups (KIVI's key layout: each column of
``U`` has its own range), ``B`` per rank row and head over the head dimension (rows scale with
``σ_i``). Options explored for the 8×/16× goal (docs/results/kv_cache.md):

- ``allocation="energy"``: instead of one ``(r_k, r_v)`` for every group, ranks go greedily to
  the (group, K or V) matrix whose next singular direction captures the most *relative* energy
  ``σ_i² / ‖X‖_F²`` per byte, under the same total budget;
- ``key_normalization=True``: keys are divided by their per-channel RMS before the shared SVD
  (outlier channels stop dominating the basis) and the scale is folded back into ``B``, so it
  costs no storage;
- exact sink tokens (``sink_tokens``) and an exact recent window (``recent_tokens``), both
  counted in the budget;
- ``hadamard=True``: quantized factors stored rotated by a randomized Hadamard transform per
  quantization group (QuaRot-style: outliers spread over the group, fewer levels wasted);
- ``value_factor_bits``: value factors at other bits than key factors (``xkv_quant_split``: 8-bit
  keys, 4-bit values; perplexity follows the key error).

References:
    Chang et al, `xKV <https://arxiv.org/abs/2503.18893>`_, 2025 (the ICML code optionally
    quantizes ``A``); Liu et al, `KIVI <https://arxiv.org/abs/2402.02750>`_, 2024.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from lowrank_jax.kv.compress import xkv_compress
from lowrank_jax.kv.quantized import (
    STORAGE_DTYPE,
    QuantizedArray,
    check_kv_bits,
    dequantize_kv,
    quantize,
    quantized_nbytes,
)
from lowrank_jax.kv.ranks import DEFAULT_GROUP_SIZE, DEFAULT_VALUE_RANK_SCALE, layer_groups

FULL_BITS = 16  # "not quantized": the factor is stored in the 16-bit float dtype
# 8-bit A and B: on the exploration window at 8x, 8/8 beat 4/8 and 4/4 (docs/results/kv_cache.md)
DEFAULT_FACTOR_BITS = 8
DEFAULT_BASIS_BITS = 8
DEFAULT_QUANT_GROUP = 32


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["key_factors", "value_factors", "key_bases", "value_bases", "sink_keys",
                 "sink_values", "recent_keys", "recent_values"],
    meta_fields=["groups", "prefill_length", "rope_theta", "hadamard"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedXKVCache:
    """xKV factors stored quantized (:class:`~lowrank_jax.kv.quantized.QuantizedArray`) or in
    fp16 (at ``FULL_BITS``). ``key_factors[g]`` ``[b, L − S − R, r_g]``, ``key_bases[l]``
    ``[b, hk, r_g, d]``; the first ``S`` prompt tokens are exact in ``sink_keys/values``
    ``[layers, b, S, hk, d]``, the last ``R`` in ``recent_keys/values``. With ``hadamard``
    the quantized factors are stored rotated (see :func:`hadamard_rotate`): ``A`` along
    tokens (padded to whole groups), ``B`` along the head dimension."""

    key_factors: tuple
    value_factors: tuple
    key_bases: tuple
    value_bases: tuple
    sink_keys: Array
    sink_values: Array
    recent_keys: Array
    recent_values: Array
    groups: tuple
    prefill_length: int
    rope_theta: float
    hadamard: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.key_bases)

    @property
    def ranks(self) -> tuple[tuple[int, int], ...]:
        shape = lambda a: a.shape if isinstance(a, QuantizedArray) else a.shape
        return tuple((shape(a)[-1], shape(v)[-1])
                     for a, v in zip(self.key_factors, self.value_factors))

    def group_of(self, layer: int) -> int:
        for g, members in enumerate(self.groups):
            if layer in members:
                return g
        raise ValueError(f"layer={layer} is outside the cache's {self.n_layers} layers.")


def randomized_hadamard(n: int) -> np.ndarray:
    """The orthonormal randomized Hadamard matrix ``H_n diag(s) / sqrt(n)`` (Sylvester ``H_n``,
    fixed random signs ``s``: nothing to store), ``n`` a power of two.

    Example::

        >>> h = randomized_hadamard(8)
        >>> bool(np.allclose(h @ h.T, np.eye(8), atol=1e-6))
        True
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard size {n} must be a power of two (set quant_group to "
                         "16, 32, 64 or 128 and use a power-of-two head_dim).")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(n).choice([-1.0, 1.0], n)
    return (h * signs / math.sqrt(n)).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def hadamard_rotate(x: jax.Array, axis: int, n: int, inverse: bool = False) -> jax.Array:
    """Rotate ``x`` along ``axis`` in consecutive blocks of ``n`` (``x.shape[axis] % n == 0``)
    by :func:`randomized_hadamard` (QuaRot-style: spreads outliers over the block so that min/max
    quantization wastes fewer levels); ``inverse=True`` undoes it."""
    h = jnp.asarray(randomized_hadamard(n).T if inverse else randomized_hadamard(n))
    moved = jnp.moveaxis(x, axis, -1)
    blocks = moved.reshape(moved.shape[:-1] + (moved.shape[-1] // n, n)) @ h
    return jnp.moveaxis(blocks.reshape(moved.shape), -1, axis)


def _padded(n: int, group: int, hadamard: bool) -> int:
    return -(-n // group) * group if hadamard else n


def _store(x, bits: int, axis: int, group: int, dtype, hadamard: bool = False):
    return _store_jit(x, bits, axis, group, jnp.dtype(dtype), bool(hadamard))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _store_jit(x, bits: int, axis: int, group: int, dtype, hadamard: bool):
    if bits == FULL_BITS:
        return x.astype(dtype)
    if hadamard:  # pad to whole blocks (zeros, stored and counted), then rotate
        n = x.shape[axis]
        pad = [(0, _padded(n, group, True) - n if i == axis else 0) for i in range(x.ndim)]
        x = hadamard_rotate(jnp.pad(x, pad), axis, group)
    return quantize(x, bits, axis=axis, group_size=group, dtype=dtype)


def _load(x, length: int | None = None, hadamard: bool = False) -> jax.Array:
    if not isinstance(x, QuantizedArray):
        return x.astype(jnp.float32)
    out = dequantize_kv(x)
    if hadamard:
        out = hadamard_rotate(out, x.axis, x.group_size, inverse=True)
        out = jax.lax.slice_in_dim(out, 0, length, axis=x.axis)
    return out


def _stored_nbytes(numel: int, groups: int, bits: int, dtype) -> int:
    if bits == FULL_BITS:
        return numel * jnp.dtype(dtype).itemsize
    return quantized_nbytes(numel, bits, groups, dtype)


def _rank_bytes(rank: int, *, batch, factored, group_layers, kv_heads, head_dim, factor_bits,
                basis_bits, quant_group, dtype, hadamard=False) -> int:
    """Bytes of one kind (K or V) of one group at ``rank``."""
    if rank == 0:
        return 0
    if factor_bits != FULL_BITS:
        factored = _padded(factored, quant_group, hadamard)
    factor = _stored_nbytes(batch * factored * rank, batch * -(-factored // quant_group) * rank,
                            factor_bits, dtype)
    basis_group = min(quant_group, head_dim)
    basis = group_layers * _stored_nbytes(batch * kv_heads * rank * head_dim,
                                          batch * kv_heads * rank * -(-head_dim // basis_group),
                                          basis_bits, dtype)
    return factor + basis


def _allocate(budget, costs, gains, full_ranks) -> list[int]:
    """Greedy: ranks to the matrix with the largest next gain per byte, within ``budget``."""
    ranks = [0] * len(costs)
    spent = 0
    heads = [(-gains[i][0] / (costs[i](1) - costs[i](0)), i) for i in range(len(costs))]
    import heapq

    heapq.heapify(heads)
    while heads:
        _, i = heapq.heappop(heads)
        step = costs[i](ranks[i] + 1) - costs[i](ranks[i])
        if spent + step > budget:
            continue
        ranks[i] += 1
        spent += step
        if ranks[i] < full_ranks[i]:
            nxt = costs[i](ranks[i] + 1) - costs[i](ranks[i])
            heapq.heappush(heads, (-gains[i][ranks[i]] / nxt, i))
    return ranks


def xkv_quant_compress(
    keys: Float[Array, "layers b L hk d"], values: Float[Array, "layers b L hk d"], *,
    rope_theta: float, ratio: float | None = None, rank: int | tuple | str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE, factor_bits: int = DEFAULT_FACTOR_BITS,
    basis_bits: int = DEFAULT_BASIS_BITS, quant_group: int = DEFAULT_QUANT_GROUP,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE, allocation: str = "uniform",
    key_normalization: bool = False, sink_tokens: int = 1, recent_tokens: int = 0,
    hadamard: bool = False, value_factor_bits: int | None = None, dtype=STORAGE_DTYPE,
    svd_cache=None,
) -> QuantizedXKVCache:
    """xKV factorization with quantized factors; ranks chosen to meet ``ratio`` (all bytes
    counted against the exact ``dtype`` cache) or given.

    Args:
        keys, values: pre-RoPE ``[layers, b, L, hk, d]``.
        rope_theta: RoPE base.
        ratio: target compression ratio; or ``rank`` (int, ``(rank_k, rank_v)`` or ``"full"``)
            for every group.
        group_size: layers per shared SVD.
        factor_bits, basis_bits: bits of ``A`` and ``B`` (2, 4, 8, or 16 = fp16, unquantized).
        quant_group: tokens per quantization group of ``A`` (channels of ``B``, capped at d).
        value_rank_scale: ``r_v / r_k`` with ``allocation="uniform"``.
        allocation: ``"uniform"`` (one ``(r_k, r_v)`` for all groups) or ``"energy"``
            (greedy by relative captured energy per byte across groups and K/V).
        key_normalization: per-channel key RMS normalisation before the SVD (folded into B).
        sink_tokens: leading prompt tokens kept exact (fp16, counted).
        recent_tokens: most recent prompt tokens kept exact (fp16, counted; ShadowKV's local
            window).
        value_factor_bits: bits of the value factors when they differ from the keys'
            (``None``: ``factor_bits``); keys need the precision, values the rank.
        hadamard: store quantized ``A`` / ``B`` rotated by a randomized Hadamard transform
            over each quantization group (``quant_group`` a power of two).
        dtype: float dtype of fp16 parts, scales and minima.
        svd_cache: an :class:`~lowrank_jax.kv.compress.SVDCache` shared across calls on the
            same prefill (each group's SVD computed once).

    Returns:
        A :class:`QuantizedXKVCache`.

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (2, 1, 64, 1, 8))
        >>> cache = xkv_quant_compress(k, k, rope_theta=1e4, ratio=4.0, group_size=2)
        >>> cache.ranks[0][1] >= cache.ranks[0][0] > 0
        True
    """
    value_factor_bits = factor_bits if value_factor_bits is None else value_factor_bits
    for name, bits in (("factor_bits", factor_bits), ("basis_bits", basis_bits),
                       ("value_factor_bits", value_factor_bits)):
        if bits != FULL_BITS:
            try:
                check_kv_bits(bits)
            except ValueError:
                raise ValueError(
                    f"{name}={bits!r} must be 2, 4, 8 or {FULL_BITS} (fp16).") from None
    if allocation not in ("uniform", "energy"):
        raise ValueError(f"allocation={allocation!r} must be 'uniform' or 'energy'.")
    if (ratio is None) == (rank is None):
        raise ValueError("give exactly one of ratio= (e.g. 8.0) or rank= (int, pair or 'full').")
    if keys.ndim != 5 or keys.shape != values.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} must both be "
                         "[layers, batch, tokens, kv_heads, head_dim].")
    n_layers, b, length, hk, d = keys.shape
    if not 0 <= sink_tokens < length:
        raise ValueError(f"sink_tokens={sink_tokens} must lie in [0, {length}).")
    if not isinstance(recent_tokens, (int, np.integer)) or not (
            0 <= recent_tokens < length - sink_tokens):
        raise ValueError(f"recent_tokens={recent_tokens!r} must be an int in "
                         f"[0, {length - sink_tokens}) (prompt minus sink tokens).")
    if hadamard:
        # power-of-two check of both sizes
        randomized_hadamard(quant_group), randomized_hadamard(min(quant_group, d))
    dt = jnp.dtype(dtype)
    groups = layer_groups(n_layers, group_size)
    end = length - recent_tokens
    factored = end - sink_tokens
    keys32, values32 = jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32)
    key_scale = None
    if key_normalization:  # per layer and channel RMS over the factorized tokens
        key_scale = jnp.sqrt(jnp.mean(keys32[:, :, sink_tokens:end] ** 2, axis=2,
                                      keepdims=True))
        key_scale = jnp.maximum(key_scale, 1e-6)
    norm_keys = keys32 if key_scale is None else keys32 / key_scale
    cost = tuple(functools.partial(_rank_bytes, batch=b, factored=factored, kv_heads=hk,
                                   head_dim=d, factor_bits=bits, basis_bits=basis_bits,
                                   quant_group=quant_group, dtype=dt, hadamard=hadamard)
                 for bits in (factor_bits, value_factor_bits))  # (keys, values)
    full = [min(factored, len(m) * hk * d) for m in groups]
    if rank is not None:
        if rank == "full":
            ranks = [(f, f) for f in full]
        else:
            pair = (int(rank), int(rank)) if np.isscalar(rank) else tuple(int(r) for r in rank)
            ranks = [pair] * len(groups)
    else:
        if not ratio > 0 or not math.isfinite(ratio):
            raise ValueError(f"ratio={ratio!r} must be a finite number > 0 (e.g. 8).")
        reference = 2 * n_layers * b * length * hk * d * dt.itemsize
        exact_bytes = 2 * n_layers * b * (sink_tokens + recent_tokens) * hk * d * dt.itemsize
        budget = reference / ratio - exact_bytes
        ranks = _choose_ranks(budget, groups, norm_keys[:, :, sink_tokens:end],
                              values32[:, :, sink_tokens:end], cost, full, allocation,
                              value_rank_scale)
    kf, vf, kb, vb = [], [], [None] * n_layers, [None] * n_layers
    for members, (rk, rv) in zip(groups, ranks):
        sl = slice(members[0], members[-1] + 1)
        part = xkv_compress(norm_keys[sl, :, :end], values32[sl, :, :end],
                            rope_theta=rope_theta, rank=(rk, rv), group_size=len(members),
                            sink_tokens=sink_tokens, svd_cache=svd_cache)
        kf.append(_store(part.key_factors[0], factor_bits, 1, quant_group, dt, hadamard))
        vf.append(_store(part.value_factors[0], value_factor_bits, 1, quant_group, dt,
                         hadamard))
        for j, layer in enumerate(members):
            basis_k = part.key_bases[j]
            if key_scale is not None:  # fold the channel scale back: B diag(s)
                basis_k = basis_k * jnp.transpose(key_scale[layer], (0, 2, 1, 3))
            group_b = min(quant_group, d)
            kb[layer] = _store(basis_k, basis_bits, 3, group_b, dt, hadamard)
            vb[layer] = _store(part.value_bases[j], basis_bits, 3, group_b, dt, hadamard)
    return QuantizedXKVCache(
        key_factors=tuple(kf), value_factors=tuple(vf), key_bases=tuple(kb),
        value_bases=tuple(vb), sink_keys=keys32[:, :, :sink_tokens].astype(dt),
        sink_values=values32[:, :, :sink_tokens].astype(dt),
        recent_keys=keys32[:, :, end:].astype(dt), recent_values=values32[:, :, end:].astype(dt),
        groups=groups, prefill_length=int(length), rope_theta=float(rope_theta),
        hadamard=bool(hadamard))


def _choose_ranks(budget, groups, keys, values, cost, full, allocation, value_rank_scale):
    if allocation == "uniform":
        out = []
        for members, f in zip(groups, full):
            share = budget * len(members) / sum(len(m) for m in groups)
            ck, cv = (functools.partial(c, group_layers=len(members)) for c in cost)
            per_rank = min(ck(1), cv(1))
            total = int(share // per_rank) + 1
            while total > 1:
                rk = int(math.floor(total / (1.0 + value_rank_scale)))
                rv = total - rk
                if rk >= 1 and ck(rk) + cv(rv) <= share:
                    break
                total -= 1
            rk = int(math.floor(total / (1.0 + value_rank_scale)))
            rv = total - rk
            if rk < 1 or rv < 1 or rk > f or rv > f:
                raise ValueError(
                    f"the target ratio leaves rank_k={rk}, rank_v={rv} for a group of "
                    f"{len(members)} layers (valid: 1..{f}); choose a ratio that is reachable "
                    "at this prompt length.")
            out.append((rk, rv))
        return out
    costs, gains, fulls = [], [], []
    for members, f in zip(groups, full):
        for src, c in zip((keys, values), cost):
            c = functools.partial(c, group_layers=len(members))
            x = jnp.concatenate([src[l].reshape(src.shape[1], src.shape[2], -1) for l in members],
                                axis=-1)
            s = np.asarray(jnp.linalg.svd(x, compute_uv=False)) ** 2  # b, min
            rel = (s / s.sum(axis=-1, keepdims=True)).mean(axis=0)
            costs.append(c)
            gains.append(np.concatenate([rel, [0.0]]))
            fulls.append(f)
    ranks = _allocate(budget, costs, gains, fulls)
    out = [(max(1, ranks[2 * i]), max(1, ranks[2 * i + 1])) for i in range(len(groups))]
    return out


def xkv_quant_reconstruct(cache: QuantizedXKVCache, layer: int, kind: str = "k"
                          ) -> Float[Array, "b L hk d"]:
    """Dense fp32 pre-RoPE keys or values of one layer's prompt (sinks first)."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind={kind!r} must be 'k' or 'v'.")
    g = cache.group_of(layer)
    sink = (cache.sink_keys if kind == "k" else cache.sink_values)[layer]
    recent = (cache.recent_keys if kind == "k" else cache.recent_values)[layer]
    factored = cache.prefill_length - sink.shape[1] - recent.shape[1]
    return _rebuild((cache.key_factors if kind == "k" else cache.value_factors)[g],
                    (cache.key_bases if kind == "k" else cache.value_bases)[layer], sink,
                    recent, factored, cache.hadamard)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _rebuild(factor, basis, sink, recent, factored: int, hadamard: bool):
    factor = _load(factor, factored, hadamard)
    basis = _load(basis, sink.shape[-1], hadamard)
    body = jnp.einsum("blr,bhrd->blhd", factor, basis)
    return jnp.concatenate([sink.astype(jnp.float32), body, recent.astype(jnp.float32)], axis=1)


__all__ = [
    "DEFAULT_BASIS_BITS", "DEFAULT_FACTOR_BITS", "DEFAULT_QUANT_GROUP", "FULL_BITS",
    "QuantizedXKVCache", "randomized_hadamard", "hadamard_rotate", "xkv_quant_compress",
    "xkv_quant_reconstruct",
]
