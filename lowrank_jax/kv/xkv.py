"""xKV: cross-layer low-rank KV-cache compression with selective reconstruction.

After prefill, the pre-RoPE keys of ``G`` adjacent layers are concatenated along the feature axis
and factorized with one truncated SVD per group (values likewise, separately):

.. math::

    X_g = [K^{(l_1)} \\,|\\, \\dots \\,|\\, K^{(l_G)}] \\in \\mathbb{R}^{L \\times G H_{kv} D}
    \\approx U_r \\Sigma_r V_r^\\top,\\qquad A_g = U_r,\\quad B_g = \\Sigma_r V_r^\\top,

so the group stores one shared token factor ``A_g`` ``[L, r]`` and, per layer, the column block
``B^{(l)}`` of ``B_g`` reshaped to ``[H_kv, r, D]``. Keys are rebuilt as ``RoPE(A_g B^{(l)}_h)``
at decode time; tokens generated after the prompt are kept exact (post-RoPE).

This module holds the compression (:func:`xkv_compress`), the byte accounting
(:func:`compressed_bytes`, :func:`uncompressed_bytes`, :func:`compression_ratio`), selective
reconstruction (:class:`SelectiveConfig`, :func:`selective_decode_attention`), and the
compressed-cache forward of :class:`lowrank_jax.models.llama.Llama` (:func:`xkv_prefill`,
:func:`xkv_decode_step`, :func:`xkv_generate`, :func:`xkv_perplexity`). The per-layer SVD
baseline is the same code with ``group_size=1``.

References:
    Chang et al, `xKV: Cross-Layer KV-Cache Compression via Aligned Singular Vector
    Extraction <https://arxiv.org/abs/2503.18893>`_, 2025.
    Sun et al, `ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference
    <https://arxiv.org/abs/2410.21465>`_, 2024 (selective reconstruction).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.attention import reference_attention
from lowrank_jax.models.llama import apply_rope
from lowrank_jax.optim.linalg import randomized_svd
from pallas_kernels.xkv_decode.api import xkv_decode_attention
from pallas_kernels.xkv_decode.reference import NEG_INF, reconstruct, rope

DEFAULT_GROUP_SIZE = 4  # xKV-4, the paper's default
DEFAULT_VALUE_RANK_SCALE = 1.5  # r_v / r_k = 576 / 384 in the paper's default setting
# Exact "attention-sink" prompt tokens kept outside the SVD by the model-level entry points
# (DERIVED, not in the paper: on SmolLM2 the first token's reconstruction error dominates the
# perplexity loss; keeping it exact costs one token of cache and closes most of the gap; see
# docs/results/xkv.md). ``xkv_compress`` itself defaults to the paper (0).
DEFAULT_SINK_TOKENS = 1
METHODS = ("xkv", "per_layer_svd", "none")


# --------------------------------------------------------------------------------------------
# grouping and rank selection
# --------------------------------------------------------------------------------------------


def layer_groups(n_layers: int, group_size: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive layer groups ``[0..G-1], [G..2G-1], ...``.

    Remainder rule (DERIVED; the reference code assumes ``G`` divides the layer count): when
    ``G`` does not divide ``n_layers``, the last group holds the ``n_layers mod G`` leftover
    layers (SmolLM2's 30 layers with ``G = 4`` give seven groups of 4 and one of 2). Its rank is
    chosen from the same target ratio for its own size, so every group meets the ratio.

    Args:
        n_layers: number of decoder layers.
        group_size: layers per group ``G``, ``1 <= G <= n_layers``.

    Returns:
        A tuple of tuples of layer indices.

    Example::

        >>> layer_groups(5, 2)
        ((0, 1), (2, 3), (4,))
    """
    if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
    if not 1 <= group_size <= n_layers:
        raise ValueError(
            f"group_size={group_size} must lie in [1, n_layers={n_layers}]; use 1 for "
            "per-layer SVD or the default 4 for xKV-4."
        )
    return tuple(tuple(range(s, min(s + group_size, n_layers)))
                 for s in range(0, n_layers, group_size))


def _full_rank(tokens: int, group_layers: int, kv_heads: int, head_dim: int) -> int:
    return min(tokens, group_layers * kv_heads * head_dim)


def _check_sink(sink_tokens, tokens: int) -> None:
    if (not isinstance(sink_tokens, (int, np.integer)) or isinstance(sink_tokens, bool)
            or not 0 <= sink_tokens < tokens):
        raise ValueError(
            f"sink_tokens={sink_tokens!r} must be an int in [0, {tokens}) (prompt length "
            f"{tokens}); it counts the leading prompt tokens kept exact, e.g. 1."
        )


def choose_ranks(
    ratio: float,
    *,
    tokens: int,
    group_layers: int,
    kv_heads: int,
    head_dim: int,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    extra_numbers: int = 0,
    sink_tokens: int = 0,
) -> tuple[int, int]:
    """Largest ``(rank_k, rank_v)`` with ``r_v ≈ s·r_k`` whose storage meets ``ratio``.

    Per batch element, a group of ``g`` layers stores ``(L' + g·H_kv·D)·(r_k + r_v)`` numbers
    (token factors over the ``L' = L − S`` factorized tokens plus per-layer bases) and
    ``2·S·g·H_kv·D`` exact numbers for ``S`` sink tokens, instead of ``2·g·L·H_kv·D``. With a
    budget ``2·g·L·H_kv·D / ratio − extra − 2·S·g·H_kv·D`` (``extra`` = exact numbers kept for
    selective reconstruction), ``r_k + r_v = ⌊budget / (L' + g·H_kv·D)⌋``,
    ``r_k = ⌊(r_k + r_v)/(1+s)⌋``. The achieved ratio is therefore ≥ ``ratio`` (equal up to
    the floor).

    Args:
        ratio: target compression ratio (uncompressed / stored bytes), > 0.
        tokens: prompt length ``L``.
        group_layers: layers in the group ``g``.
        kv_heads, head_dim: ``H_kv`` and ``D``.
        value_rank_scale: ``s = r_v / r_k`` (DERIVED default 1.5 from the paper's 384/576).
        extra_numbers: numbers per batch element stored besides the factors.
        sink_tokens: ``S`` leading prompt tokens kept exact (outside the SVD).

    Returns:
        ``(rank_k, rank_v)``.

    Example::

        >>> choose_ranks(8.0, tokens=1024, group_layers=4, kv_heads=3, head_dim=64)
        (43, 66)
    """
    if not ratio > 0 or not math.isfinite(ratio):
        raise ValueError(f"ratio={ratio!r} must be a finite number > 0 (e.g. 2, 4 or 8).")
    if not value_rank_scale > 0:
        raise ValueError(f"value_rank_scale={value_rank_scale!r} must be > 0.")
    _check_sink(sink_tokens, tokens)
    features = group_layers * kv_heads * head_dim
    factored = tokens - sink_tokens
    budget = (2 * group_layers * tokens * kv_heads * head_dim / ratio - extra_numbers
              - 2 * sink_tokens * features)
    total = int(math.floor(budget / (factored + features) + 1e-9))
    rank_k = int(math.floor(total / (1.0 + value_rank_scale)))
    rank_v = total - rank_k
    full = _full_rank(factored, group_layers, kv_heads, head_dim)
    if rank_k < 1 or rank_v < 1:
        raise ValueError(
            f"ratio={ratio} cannot be met for a group of {group_layers} layers at {tokens} "
            f"tokens: it leaves rank_k={rank_k}, rank_v={rank_v} (< 1). Lower the ratio, use a "
            "longer prompt or a larger group_size."
        )
    if rank_k > full or rank_v > full:
        raise ValueError(
            f"ratio={ratio} is too low for a group of {group_layers} layers at {tokens} tokens: "
            f"it asks for rank_k={rank_k}, rank_v={rank_v} above the full rank {full}, so the "
            "factors would take more memory than needed. Raise the ratio (or use the exact cache)."
        )
    return rank_k, rank_v


def predicted_compression_ratio(
    *, n_layers: int, kv_heads: int, head_dim: int, tokens: int, group_size: int,
    rank_k: int, rank_v: int,
) -> float:
    """Analytic ratio of the reference repo's calculator (all layers compressed, ``G | N_L``).

    ``CR = 2·N_L·H_kv·L·D / (N_groups·L·(r_k+r_v) + N_L·H_kv·D·(r_k+r_v))``.

    Example::

        >>> round(predicted_compression_ratio(n_layers=32, kv_heads=8, head_dim=128,
        ...     tokens=65536, group_size=4, rank_k=384, rank_v=576), 2)
        8.03
    """
    groups = len(layer_groups(n_layers, group_size))
    full = 2 * n_layers * kv_heads * tokens * head_dim
    stored = groups * tokens * (rank_k + rank_v) + n_layers * kv_heads * head_dim * (
        rank_k + rank_v)
    return full / stored


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SelectiveConfig:
    """Selective reconstruction (xKV-SR, after ShadowKV) settings.

    Attributes:
        budget: prompt tokens rebuilt per KV head and decode step (``budget // chunk_size``
            chunks are selected).
        chunk_size: tokens per chunk (landmark = mean post-RoPE key of the chunk).
        local_chunks: the last ``L − chunk_size·(L//chunk_size − local_chunks)`` prompt tokens
            are kept exact (the local window).
        outlier_chunks: chunks per KV head with the lowest min-cosine to their landmark, kept
            exact. ``None`` = the repo default ``(budget // 1024)·24``.
    """

    budget: int = 2048
    chunk_size: int = 8
    local_chunks: int = 4
    outlier_chunks: int | None = None

    def resolved_outliers(self) -> int:
        return (self.budget // 1024) * 24 if self.outlier_chunks is None else self.outlier_chunks

    def layout(self, tokens: int) -> tuple[int, int, int]:
        """``(scored_chunks, outlier_chunks, selected_chunks)`` for a ``tokens``-long prompt."""
        for name in ("budget", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SelectiveConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.local_chunks < 0 or self.resolved_outliers() < 0:
            raise ValueError("SelectiveConfig.local_chunks and outlier_chunks must be >= 0.")
        chunks = tokens // self.chunk_size - self.local_chunks
        outliers = self.resolved_outliers()
        if chunks - outliers < 1:
            raise ValueError(
                f"selective reconstruction needs more prompt: {tokens} tokens give {chunks} "
                f"scored chunks of {self.chunk_size}, but {outliers} outlier chunks are kept "
                "exact. Lower outlier_chunks/local_chunks or use a longer prompt."
            )
        return chunks, outliers, min(self.budget // self.chunk_size, chunks - outliers)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["landmarks", "selectable", "outlier_keys", "outlier_values", "local_keys",
                 "local_values"],
    meta_fields=["chunk_size", "selected_chunks"],
)
@dataclasses.dataclass(frozen=True)
class SelectiveState:
    """Per-layer data for selective reconstruction (tuples indexed by layer).

    ``landmarks [b, hk, C, d]`` (post-RoPE chunk means), ``selectable [b, hk, C]`` (False for
    outlier chunks), exact post-RoPE ``outlier_keys/values [b, hk, n_out·chunk, d]`` and
    ``local_keys/values [b, hk, W, d]``.
    """

    landmarks: tuple
    selectable: tuple
    outlier_keys: tuple
    outlier_values: tuple
    local_keys: tuple
    local_values: tuple
    chunk_size: int
    selected_chunks: int


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["key_factors", "value_factors", "key_bases", "value_bases", "sink_keys",
                 "sink_values", "tail_keys", "tail_values", "tail_length", "selective"],
    meta_fields=["groups", "prefill_length", "rope_theta"],
)
@dataclasses.dataclass(frozen=True)
class XKVCache:
    """A compressed prompt cache plus an exact decode tail (a pytree; jit-friendly).

    Attributes:
        key_factors, value_factors: per group, the shared token factor ``[b, L − S, rank]``;
            its row ``j`` is prompt token ``S + j``.
        key_bases, value_bases: per layer, ``[b, kv_heads, rank, head_dim]``.
        sink_keys, sink_values: ``[layers, b, S, kv_heads, head_dim]``, the first ``S`` prompt
            tokens kept exact (pre-RoPE keys); ``S = 0`` is the paper's xKV.
        tail_keys, tail_values: ``[layers, b, capacity, kv_heads, head_dim]`` exact post-RoPE
            keys / values of tokens appended after the prompt (keys rotated at their position
            minus ``S``, the frame of the decode kernel; see :func:`xkv_decode_step`).
        tail_length: scalar int32, filled tail rows.
        selective: :class:`SelectiveState` or None.
        groups: the layer groups (static).
        prefill_length: prompt length ``L`` (static); tail token ``j`` sits at ``L + j``.
        rope_theta: RoPE base used to rotate rebuilt keys (static).
    """

    key_factors: tuple
    value_factors: tuple
    key_bases: tuple
    value_bases: tuple
    sink_keys: Array
    sink_values: Array
    tail_keys: Array
    tail_values: Array
    tail_length: Array
    selective: SelectiveState | None
    groups: tuple
    prefill_length: int
    rope_theta: float

    @property
    def n_layers(self) -> int:
        return len(self.key_bases)

    @property
    def sink_tokens(self) -> int:
        """``S``, the leading prompt tokens stored exactly."""
        return self.sink_keys.shape[2]

    def group_of(self, layer: int) -> int:
        for g, members in enumerate(self.groups):
            if layer in members:
                return g
        raise ValueError(f"layer={layer} is outside the cache's {self.n_layers} layers.")

    @property
    def ranks(self) -> tuple[tuple[int, int], ...]:
        """``(rank_k, rank_v)`` per group."""
        return tuple((a.shape[-1], v.shape[-1])
                     for a, v in zip(self.key_factors, self.value_factors))


def _layer_selective_state(keys_rot, values, cfg: SelectiveConfig):
    """Landmarks, outliers and local window of one layer (post-RoPE keys ``[b, L, hk, d]``)."""
    b, length, hk, d = keys_rot.shape
    chunks, outliers, _ = cfg.layout(length)
    cs = cfg.chunk_size
    body = keys_rot[:, : chunks * cs].reshape(b, chunks, cs, hk, d)
    landmarks = body.mean(axis=2)  # b C hk d
    unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    cos = jnp.einsum("bchd,bcshd->bchs", unit(landmarks), unit(body))
    min_cos = jnp.transpose(cos.min(axis=-1), (0, 2, 1))  # b hk C
    landmarks = jnp.transpose(landmarks, (0, 2, 1, 3))  # b hk C d
    keys_h = jnp.transpose(keys_rot, (0, 2, 1, 3))  # b hk L d
    values_h = jnp.transpose(values, (0, 2, 1, 3))
    if outliers:
        _, out_idx = jax.lax.top_k(-min_cos, outliers)  # b hk n_out
        selectable = ~jnp.any(jnp.arange(chunks) == out_idx[..., None], axis=-2)
        tok = (out_idx[..., None] * cs + jnp.arange(cs)).reshape(b, hk, outliers * cs)
        gather = lambda x: jnp.take_along_axis(x, tok[..., None], axis=2)
        out_k, out_v = gather(keys_h), gather(values_h)
    else:
        selectable = jnp.ones((b, hk, chunks), bool)
        out_k = out_v = jnp.zeros((b, hk, 0, d), keys_rot.dtype)
    return (landmarks, selectable, out_k, out_v, keys_h[:, :, chunks * cs:],
            values_h[:, :, chunks * cs:])


def _selective_extra_numbers(tokens, group_layers, kv_heads, head_dim, cfg: SelectiveConfig):
    """Stored numbers per batch element (counted like fp values) for SR in one group."""
    chunks, outliers, _ = cfg.layout(tokens)
    local = tokens - chunks * cfg.chunk_size
    per_layer = kv_heads * (chunks * head_dim + chunks  # landmarks + selectable flags
                            + 2 * outliers * cfg.chunk_size * head_dim + 2 * local * head_dim)
    return group_layers * per_layer


def xkv_compress(
    keys: Float[Array, "layers b L hk d"],
    values: Float[Array, "layers b L hk d"],
    *,
    rope_theta: float,
    ratio: float | None = None,
    rank: int | tuple[int, int] | str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    selective: SelectiveConfig | None = None,
    tail_capacity: int = 0,
    dtype=None,
    sink_tokens: int = 0,
    svd_method: str = "full",
    oversample: int = 16,
) -> XKVCache:
    """Factorize a prefilled cache: one truncated SVD per layer group, keys and values apart.

    .. math::

        [K^{(l_1)}|\\dots|K^{(l_G)}] = U \\Sigma V^\\top,\\quad A = U_{:, :r},\\quad
        B^{(l)}_h = (\\Sigma_r V_r^\\top)[:, \\text{cols}(l, h)]

    The SVD runs in fp32, per sequence of the batch: exact (``svd_method="full"``, the
    default, so results are deterministic and match the test oracle) or a randomized range
    finder with 2 power iterations (``"randomized"``, the reference code's choice,
    ``O(L·F·(r + oversample))`` instead of ``O(L·F·min(L, F))``). On SmolLM2 at 8× the
    randomized one compresses ~3× faster on CPU, with relative K/V errors within 1 % of exact
    (docs/results/xkv.md).

    Args:
        keys: pre-RoPE keys of every layer, ``[layers, b, L, kv_heads, head_dim]``.
        values: values, same shape.
        rope_theta: RoPE base (used for selective-reconstruction landmarks and decode).
        ratio: target compression ratio; ranks come from :func:`choose_ranks` per group.
        rank: explicit ``rank`` or ``(rank_k, rank_v)`` per group instead of ``ratio``;
            ``"full"`` keeps ``min(L, G·H_kv·D)`` per group (lossless, for testing).
        group_size: ``G`` adjacent layers per SVD (1 = per-layer SVD baseline).
        value_rank_scale: ``r_v / r_k`` when ``ratio`` is given.
        selective: enable selective reconstruction with these settings.
        tail_capacity: preallocated exact rows for generated tokens.
        dtype: storage dtype of factors and tail (default: ``keys.dtype``).
        sink_tokens: keep the first ``S`` prompt tokens exact and factorize only the rest
            (DERIVED, not in the paper, which uses 0: the first token is an attention sink
            whose error costs far more perplexity than its one token of storage; the byte
            count and ``ratio`` include it). Not combinable with ``selective``, which keeps
            its own exact outlier chunks.
        svd_method: ``"full"`` (exact) or ``"randomized"``.
        oversample: extra sketch columns of the randomized range finder (the reference code
            uses none; 16 costs little and makes the top singular vectors accurate).

    Returns:
        An :class:`XKVCache`.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> k = jax.random.normal(jax.random.key(0), (4, 1, 16, 2, 8))
        >>> cache = xkv_compress(k, k, rope_theta=1e4, rank=(4, 6), group_size=2)
        >>> cache.ranks
        ((4, 6), (4, 6))
    """
    if keys.ndim != 5 or keys.shape != values.shape:
        raise ValueError(
            f"keys {keys.shape} and values {values.shape} must both be "
            "[layers, batch, tokens, kv_heads, head_dim]."
        )
    if (ratio is None) == (rank is None):
        raise ValueError(
            "give exactly one of ratio= (e.g. 8.0) or rank= (int, (rank_k, rank_v) or 'full')."
        )
    if rank is not None and not isinstance(rank, str) and not np.isscalar(rank):
        rank = tuple(int(r) for r in rank)
    _check_sink(sink_tokens, keys.shape[2])
    if svd_method not in ("full", "randomized"):
        raise ValueError(f"svd_method={svd_method!r} must be 'full' (exact) or 'randomized'.")
    if not isinstance(oversample, (int, np.integer)) or oversample < 0:
        raise ValueError(f"oversample={oversample!r} must be an int >= 0 (default 16).")
    if sink_tokens and selective is not None:
        raise ValueError(
            "sink_tokens > 0 cannot be combined with selective reconstruction, which keeps its "
            "own exact outlier chunks and local window; pass sink_tokens=0 with selective=."
        )
    return _xkv_compress(
        jnp.asarray(keys), jnp.asarray(values), rope_theta=float(rope_theta),
        ratio=None if ratio is None else float(ratio), rank=rank, group_size=group_size,
        value_rank_scale=float(value_rank_scale), selective=selective,
        tail_capacity=int(tail_capacity), dtype=None if dtype is None else jnp.dtype(dtype).name,
        sink_tokens=int(sink_tokens), svd_method=svd_method, oversample=int(oversample),
    )


@functools.partial(jax.jit, static_argnames=(
    "rope_theta", "ratio", "rank", "group_size", "value_rank_scale", "selective",
    "tail_capacity", "dtype", "sink_tokens", "svd_method", "oversample"))
def _xkv_compress(keys, values, *, rope_theta, ratio, rank, group_size, value_rank_scale,
                  selective, tail_capacity, dtype, sink_tokens, svd_method,
                  oversample) -> XKVCache:
    n_layers, b, length, hk, d = keys.shape
    dtype = jnp.dtype(dtype or keys.dtype)
    groups = layer_groups(n_layers, group_size)
    positions = jnp.arange(length)
    sink_keys, sink_values = keys[:, :, :sink_tokens], values[:, :, :sink_tokens]
    full_keys, full_values = keys, values
    keys, values = keys[:, :, sink_tokens:], values[:, :, sink_tokens:]
    factored = length - sink_tokens
    key_factors, value_factors = [], []
    key_bases, value_bases = [None] * n_layers, [None] * n_layers
    for members in groups:
        g = len(members)
        if rank == "full":
            rank_k = rank_v = _full_rank(factored, g, hk, d)
        elif rank is not None:
            rank_k, rank_v = (rank, rank) if np.isscalar(rank) else tuple(rank)
            full = _full_rank(factored, g, hk, d)
            for name, r in (("rank_k", rank_k), ("rank_v", rank_v)):
                if not 1 <= int(r) <= full:
                    raise ValueError(
                        f"{name}={r} must lie in [1, {full}] (full rank of a {factored} x "
                        f"{g * hk * d} group matrix)."
                    )
        else:
            extra = 0 if selective is None else _selective_extra_numbers(length, g, hk, d,
                                                                         selective)
            rank_k, rank_v = choose_ranks(ratio, tokens=length, group_layers=g, kv_heads=hk,
                                          head_dim=d, value_rank_scale=value_rank_scale,
                                          extra_numbers=extra, sink_tokens=sink_tokens)
        for src, r, factors, bases in ((keys, rank_k, key_factors, key_bases),
                                       (values, rank_v, value_factors, value_bases)):
            x = jnp.concatenate([src[l].reshape(b, factored, hk * d) for l in members], axis=-1)
            u, s, vt = _truncated_svd(x.astype(jnp.float32), r, svd_method, oversample)
            factors.append(u[:, :, :r].astype(dtype))
            basis = (s[:, :r, None] * vt[:, :r, :]).reshape(b, r, g, hk, d)
            for j, l in enumerate(members):
                bases[l] = jnp.transpose(basis[:, :, j], (0, 2, 1, 3)).astype(dtype)
    sel = None
    if selective is not None:
        parts = [_layer_selective_state(rope(full_keys[l], positions, rope_theta).astype(dtype),
                                        full_values[l].astype(dtype), selective)
                 for l in range(n_layers)]
        sel = SelectiveState(*[tuple(p[i] for p in parts) for i in range(6)],
                             chunk_size=selective.chunk_size,
                             selected_chunks=selective.layout(length)[2])
    tail_shape = (n_layers, b, tail_capacity, hk, d)
    return XKVCache(
        key_factors=tuple(key_factors), value_factors=tuple(value_factors),
        key_bases=tuple(key_bases), value_bases=tuple(value_bases),
        sink_keys=sink_keys.astype(dtype), sink_values=sink_values.astype(dtype),
        tail_keys=jnp.zeros(tail_shape, dtype), tail_values=jnp.zeros(tail_shape, dtype),
        tail_length=jnp.zeros((), jnp.int32), selective=sel, groups=groups,
        prefill_length=length, rope_theta=float(rope_theta),
    )


def _truncated_svd(x: Float[Array, "b L F"], rank: int, method: str, oversample: int):
    """Top-``rank`` (at least) singular triplets of each ``x[i]``: exact or randomized."""
    if method == "full" or rank + oversample >= min(x.shape[1:]):
        return jnp.linalg.svd(x, full_matrices=False)
    keys = jax.random.split(jax.random.key(0), x.shape[0])
    return jax.vmap(lambda m, k: randomized_svd(m, rank, oversample=oversample, power_iters=2,
                                                key=k))(x, keys)


def xkv_reconstruct(cache: XKVCache, layer: int, kind: str = "k") -> Float[Array, "b L hk d"]:
    """Dense pre-RoPE keys (``kind="k"``) or values (``"v"``) of one layer's prompt (exact
    sink tokens first, then the rebuilt tokens), fp32.

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (2, 1, 8, 1, 4))
        >>> cache = xkv_compress(k, k, rope_theta=1e4, rank=8, group_size=2)
        >>> bool(abs(xkv_reconstruct(cache, 1) - k[1]).max() < 1e-4)
        True
    """
    if kind not in ("k", "v"):
        raise ValueError(f"kind={kind!r} must be 'k' or 'v'.")
    g = cache.group_of(layer)
    if kind == "k":
        body, sink = reconstruct(cache.key_factors[g], cache.key_bases[layer]), cache.sink_keys
    else:
        body, sink = reconstruct(cache.value_factors[g], cache.value_bases[layer]), \
            cache.sink_values
    if cache.sink_tokens == 0:
        return body
    return jnp.concatenate([sink[layer].astype(jnp.float32), body], axis=1)


# --------------------------------------------------------------------------------------------
# byte accounting
# --------------------------------------------------------------------------------------------


def _tail_token_bytes(cache: XKVCache) -> int:
    n, b, _, hk, d = cache.tail_keys.shape
    return 2 * n * b * hk * d * cache.tail_keys.dtype.itemsize


def compressed_bytes(cache: XKVCache) -> int:
    """Bytes actually stored: every factor/basis/SR array, plus the filled tail rows.

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (2, 1, 16, 1, 4))
        >>> # factors 2 kinds x [1, 16, 2] + bases 2 kinds x 2 layers x [1, 1, 2, 4], fp32
        >>> compressed_bytes(xkv_compress(k, k, rope_theta=1e4, rank=2, group_size=2))
        384
    """
    arrays = [cache.key_factors, cache.value_factors, cache.key_bases, cache.value_bases,
              cache.sink_keys, cache.sink_values, cache.selective]
    stored = sum(int(x.nbytes) for x in jax.tree.leaves(arrays))
    return stored + int(cache.tail_length) * _tail_token_bytes(cache)


def uncompressed_bytes(cache: XKVCache) -> int:
    """Bytes of the exact K and V of the same tokens in the same dtype (``2·N·b·T·H_kv·D``)."""
    return (cache.prefill_length + int(cache.tail_length)) * _tail_token_bytes(cache)


def compression_ratio(cache: XKVCache) -> float:
    """``uncompressed_bytes / compressed_bytes`` (> 1 means the cache is smaller).

    The brief's "stored bytes over uncompressed bytes" is the reciprocal, the memory fraction.
    """
    return uncompressed_bytes(cache) / compressed_bytes(cache)


# --------------------------------------------------------------------------------------------
# decode attention (dense and selective)
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(2,))
def selective_decode_attention(
    q: Float[Array, "b hq d"], cache: XKVCache, layer: int, *, tail_keys=None, tail_values=None,
    tail_length=None,
) -> Float[Array, "b hq d"]:
    """xKV-SR decode attention of one layer: rebuild only the top-scoring chunks.

    Per KV head, chunk scores are ``max_{heads in group} softmax(q·landmarksᵀ/√D)``; outlier
    chunks are excluded (they are exact); the top ``budget/chunk`` chunks are rebuilt from the
    factors (``RoPE(A[idx] B_h, idx)``, ``A_v[idx] B_{v,h}``) and exact attention runs over
    ``[local | outliers | selected | tail]``.

    Args:
        q: post-RoPE queries ``[b, q_heads, d]``.
        cache: an :class:`XKVCache` built with ``selective=``.
        layer: the layer index.
        tail_keys, tail_values, tail_length: exact tail of this layer (``[b, T, hk, d]``).

    Returns:
        ``[b, q_heads, d]`` fp32.

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (1, 1, 32, 1, 4))
        >>> cache = xkv_compress(k, k, rope_theta=1e4, rank=3, group_size=1,
        ...     selective=SelectiveConfig(budget=8, chunk_size=4, local_chunks=1,
        ...                               outlier_chunks=1))
        >>> selective_decode_attention(jax.numpy.ones((1, 2, 4)), cache, 0).shape
        (1, 2, 4)
    """
    sel = cache.selective
    if sel is None:
        raise ValueError("cache has no selective state; build it with selective=SelectiveConfig().")
    b, hq, d = q.shape
    g = cache.group_of(layer)
    a_k, a_v = cache.key_factors[g], cache.value_factors[g]
    b_k, b_v = cache.key_bases[layer], cache.value_bases[layer]
    hk = b_k.shape[1]
    groups = hq // hk
    scale = d ** -0.5
    qg = q.astype(jnp.float32).reshape(b, hk, groups, d)
    lm = sel.landmarks[layer].astype(jnp.float32)
    chunk_scores = jax.nn.softmax(jnp.einsum("bhgd,bhcd->bhgc", qg, lm) * scale, axis=-1)
    chunk_scores = jnp.where(sel.selectable[layer], chunk_scores.max(axis=2), -1.0)
    _, idx = jax.lax.top_k(chunk_scores, sel.selected_chunks)  # b hk n
    cs = sel.chunk_size
    tok = (idx[..., None] * cs + jnp.arange(cs)).reshape(b, hk, -1)  # b hk n*cs
    rows = lambda a: jnp.take_along_axis(a[:, None].astype(jnp.float32), tok[..., None], axis=2)
    k_sel = jnp.einsum("bhnr,bhrd->bhnd", rows(a_k), b_k.astype(jnp.float32))
    angles = tok.astype(jnp.float32)[..., None] * (
        1.0 / (cache.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    k1, k2 = jnp.split(k_sel, 2, axis=-1)
    k_sel = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)
    v_sel = jnp.einsum("bhnr,bhrd->bhnd", rows(a_v), b_v.astype(jnp.float32))
    keys = [sel.local_keys[layer], sel.outlier_keys[layer], k_sel]
    vals = [sel.local_values[layer], sel.outlier_values[layer], v_sel]
    n_fixed = sum(k.shape[2] for k in keys)
    valid = [jnp.ones((n_fixed,), bool)]
    if tail_keys is not None:
        t = tail_keys.shape[1]
        keys.append(jnp.transpose(tail_keys, (0, 2, 1, 3)))
        vals.append(jnp.transpose(tail_values, (0, 2, 1, 3)))
        valid.append(jnp.arange(t) < (t if tail_length is None else tail_length))
    keys = jnp.concatenate([k.astype(jnp.float32) for k in keys], axis=2)
    vals = jnp.concatenate([v.astype(jnp.float32) for v in vals], axis=2)
    valid = jnp.concatenate(valid)
    logits = jnp.where(valid, jnp.einsum("bhgd,bhnd->bhgn", qg, keys) * scale, NEG_INF)
    probs = jnp.where(valid, jax.nn.softmax(logits, axis=-1), 0.0)
    return jnp.einsum("bhgn,bhnd->bhgd", probs, vals).reshape(b, hq, d)


# --------------------------------------------------------------------------------------------
# the compressed-cache forward of the Llama model
# --------------------------------------------------------------------------------------------


def _resolve_sink(sink_tokens: int | None, selective) -> int:
    """``None`` means :data:`DEFAULT_SINK_TOKENS`, or 0 with selective reconstruction."""
    if sink_tokens is None:
        return 0 if selective is not None else DEFAULT_SINK_TOKENS
    return sink_tokens


def _mlp_residual(layer, x, attn):
    b, t = x.shape[:2]
    x = x + layer.self_attn.o_proj(attn.reshape(b, t, -1).astype(x.dtype))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@nnx.jit
def _prefill_forward(model, tokens):
    """Exact causal forward; returns final hidden states and pre-RoPE K, V of every layer."""
    cfg = model.cfg
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    x = model.embed_tokens(tokens).astype(jnp.dtype(cfg.dtype))
    keys, values = [], []
    for layer in model.layers:
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x))
        keys.append(k)
        values.append(v)
        attn = reference_attention(apply_rope(q, positions, cfg.rope_theta),
                                   apply_rope(k, positions, cfg.rope_theta), v, causal=True)
        x = _mlp_residual(layer, x, attn)
    return model.norm(x), jnp.stack(keys), jnp.stack(values)


@nnx.jit
def _block_forward(model, tokens, context_keys, context_values):
    """Teacher-forced block after a context given as dense post-RoPE K and V per layer.

    ``tokens [b, t]`` sit at positions ``C..C+t-1``; query ``i`` sees the whole context and the
    exact new keys ``<= i``. Returns fp32 logits ``[b, t, vocab]``.
    """
    cfg = model.cfg
    b, t = tokens.shape
    c = context_keys.shape[2]
    positions = jnp.broadcast_to(c + jnp.arange(t)[None], (b, t))
    x = model.embed_tokens(tokens).astype(jnp.dtype(cfg.dtype))
    for i, layer in enumerate(model.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x))
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)
        keys = jnp.concatenate([context_keys[i].astype(k.dtype), k], axis=1)
        vals = jnp.concatenate([context_values[i].astype(v.dtype), v], axis=1)
        attn = reference_attention(q, keys, vals, causal=True, q_offset=c)
        x = _mlp_residual(layer, x, attn)
    return model.logits_from_hidden(model.norm(x))


def xkv_prefill(
    model,
    tokens: Int[Array, "b L"],
    *,
    ratio: float | None = 8.0,
    group_size: int = DEFAULT_GROUP_SIZE,
    rank: int | tuple[int, int] | None = None,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    selective: SelectiveConfig | None = None,
    max_new_tokens: int = 256,
    sink_tokens: int | None = None,
) -> XKVCache:
    """Run the exact prefill of ``tokens`` through ``model`` and compress its KV cache.

    Args:
        model: a :class:`lowrank_jax.models.llama.Llama`.
        tokens: prompt ``[b, L]``.
        ratio: target compression ratio (ignored when ``rank`` is given).
        group_size: layers per SVD group (1 = per-layer SVD).
        rank: explicit ``rank`` / ``(rank_k, rank_v)`` per group.
        value_rank_scale: ``r_v / r_k`` for ratio-chosen ranks.
        selective: enable selective reconstruction at decode.
        max_new_tokens: exact tail capacity for :func:`xkv_decode_step`.
        sink_tokens: leading prompt tokens kept exact (default :data:`DEFAULT_SINK_TOKENS`,
            or 0 with ``selective``; 0 is the paper's xKV).

    Returns:
        An :class:`XKVCache` (the prompt's own logits are not returned: feed the last prompt
        token through :func:`xkv_decode_step`, as :func:`xkv_generate` does).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> cache = xkv_prefill(model, jnp.zeros((1, 12), jnp.int32), rank=4, group_size=2)
        >>> logits, cache = xkv_decode_step(model, cache, jnp.zeros((1,), jnp.int32))
        >>> logits.shape
        (1, 32)
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [batch, length].")
    _, keys, values = _prefill_forward(model, tokens)
    return xkv_compress(
        keys, values, rope_theta=model.cfg.rope_theta, ratio=None if rank is not None else ratio,
        rank=rank, group_size=group_size, value_rank_scale=value_rank_scale,
        selective=selective, tail_capacity=max_new_tokens,
        sink_tokens=_resolve_sink(sink_tokens, selective),
    )


@functools.partial(nnx.jit, static_argnames=("implementation",))
def _decode_step(model, cache: XKVCache, token, implementation: str):
    cfg = model.cfg
    b = token.shape[0]
    step = cache.tail_length
    # RoPE frame shifted by the S exact sink tokens: factor row j (prompt token S + j) sits at
    # j, which is where the decode kernel rotates it; queries, the tail and the sinks are
    # rotated at (true position - S). Scores only depend on position differences, so this is
    # exact attention over [sinks | rebuilt prompt | tail].
    shift = cache.sink_tokens
    positions = jnp.broadcast_to(cache.prefill_length - shift + step, (b, 1))
    x = model.embed_tokens(token[:, None]).astype(jnp.dtype(cfg.dtype))
    tail_keys, tail_values = [], []
    sink_k = sink_v = None
    if shift:
        sink_pos = jnp.arange(shift) - shift
        sink_k = jax.vmap(lambda k: rope(k, sink_pos, cache.rope_theta))(cache.sink_keys)
        sink_v = cache.sink_values.astype(jnp.float32)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x))
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)
        tk = jax.lax.dynamic_update_slice(cache.tail_keys[i], k.astype(cache.tail_keys.dtype),
                                          (0, step, 0, 0))
        tv = jax.lax.dynamic_update_slice(cache.tail_values[i],
                                          v.astype(cache.tail_values.dtype), (0, step, 0, 0))
        tail_keys.append(tk)
        tail_values.append(tv)
        if cache.selective is not None:
            attn = selective_decode_attention(q[:, 0], cache, i, tail_keys=tk, tail_values=tv,
                                              tail_length=step + 1)
        else:
            g = cache.group_of(i)
            exact_k, exact_v, exact_n = tk, tv, step + 1
            if shift:
                exact_k = jnp.concatenate([sink_k[i].astype(tk.dtype), tk], axis=1)
                exact_v = jnp.concatenate([sink_v[i].astype(tv.dtype), tv], axis=1)
                exact_n = exact_n + shift
            attn = xkv_decode_attention(
                q[:, 0], cache.key_factors[g], cache.key_bases[i], cache.value_factors[g],
                cache.value_bases[i], rope_theta=cache.rope_theta, tail_keys=exact_k,
                tail_values=exact_v, tail_length=exact_n, implementation=implementation,
            )
        x = _mlp_residual(layer, x, attn[:, None])
    logits = model.logits_from_hidden(model.norm(x))[:, 0]
    cache = dataclasses.replace(cache, tail_keys=jnp.stack(tail_keys),
                                tail_values=jnp.stack(tail_values), tail_length=step + 1)
    return logits, cache


def xkv_decode_step(
    model, cache: XKVCache, token: Int[Array, "b"], *, implementation: str = "auto"
) -> tuple[Float[Array, "b vocab"], XKVCache]:
    """Feed one token per sequence; attend to the compressed prompt and the exact tail.

    The new token's key/value is appended (exact, post-RoPE) to the tail before attention, so
    the token sees itself, as in the uncompressed model.

    Args:
        model: the :class:`~lowrank_jax.models.llama.Llama` that produced ``cache``.
        cache: from :func:`xkv_prefill`.
        token: ``[b]`` token ids (``[b, 1]`` is accepted too).
        implementation: decode-attention kernel choice (``"auto"``, ``"pallas"``, ``"xla"``).

    Returns:
        ``(logits [b, vocab] fp32, the advanced cache)``.
    """
    token = jnp.asarray(token)
    if token.ndim == 2 and token.shape[1] == 1:
        token = token[:, 0]
    if token.ndim != 1 or token.shape[0] != cache.tail_keys.shape[1]:
        raise ValueError(
            f"token has shape {token.shape}; expected [{cache.tail_keys.shape[1]}] (one id per "
            "sequence of the cache's batch)."
        )
    if int(cache.tail_length) >= cache.tail_keys.shape[2]:
        raise ValueError(
            f"the cache's exact tail is full ({cache.tail_keys.shape[2]} tokens); prefill with a "
            "larger max_new_tokens."
        )
    return _decode_step(model, cache, token, implementation)


def xkv_generate(
    model, prompt: Int[Array, "b P"], *, max_new_tokens: int, ratio: float | None = 8.0,
    group_size: int = DEFAULT_GROUP_SIZE, rank=None,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    selective: SelectiveConfig | None = None, implementation: str = "auto",
    sink_tokens: int | None = None,
) -> Int[Array, "b n"]:
    """Greedy generation with a compressed prompt cache.

    The prompt minus its last token is prefilled and compressed; the last prompt token and every
    generated token then go through :func:`xkv_decode_step`, so each new token is predicted from
    the compressed prompt plus the exact tail.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> xkv_generate(model, jnp.zeros((1, 12), jnp.int32), max_new_tokens=3,
        ...              rank=4, group_size=2).shape
        (1, 3)
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 2:
        raise ValueError(f"prompt has shape {prompt.shape}; expected [batch, length >= 2].")
    cache = xkv_prefill(model, prompt[:, :-1], ratio=ratio, group_size=group_size, rank=rank,
                        value_rank_scale=value_rank_scale, selective=selective,
                        max_new_tokens=max_new_tokens, sink_tokens=sink_tokens)
    token, out = prompt[:, -1], []
    for _ in range(max_new_tokens):
        logits, cache = xkv_decode_step(model, cache, token, implementation=implementation)
        token = jnp.argmax(logits, axis=-1).astype(prompt.dtype)
        out.append(token)
    return jnp.stack(out, axis=1)


def _method_group_size(method: str, group_size: int) -> int:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; choose from {METHODS}.")
    return 1 if method == "per_layer_svd" else group_size


def xkv_perplexity_sweep(
    model, ids, *, context_len: int, eval_len: int, settings: Sequence[tuple],
    group_size: int = DEFAULT_GROUP_SIZE, value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
) -> list[dict]:
    """Perplexity of ``eval_len`` tokens after a compressed ``context_len`` context, per setting.

    Protocol (identical for every method): prefill ``ids[:, :C]`` exactly, compress its KV cache
    (``"none"`` keeps it exact), then score ``ids[:, C+1 : C+E+1]`` from inputs
    ``ids[:, C : C+E]`` in one teacher-forced block whose queries attend to the (rebuilt,
    re-rotated) context plus the exact new tokens, which is what token-by-token decoding with an
    exact tail computes. The prefill is shared by all settings.

    Args:
        model: a Llama.
        ids: ``[T]`` or ``[b, T]`` token ids with ``T >= context_len + eval_len + 1``.
        context_len, eval_len: ``C`` and ``E``.
        settings: ``(method, ratio[, sink_tokens[, group_size]])`` tuples, method in
            ``METHODS`` (``ratio`` ignored for ``"none"``; omitted entries take the keyword
            defaults below).
        group_size: ``G`` for ``"xkv"``.
        value_rank_scale: ``r_v / r_k``.
        sink_tokens: exact leading tokens for settings that do not give their own.

    Returns:
        One dict per setting: ``method, target_ratio, sink_tokens, group_size,
        compression_ratio, rank_k,
        rank_v (first group), key_error, value_error`` (relative Frobenius error of the pre-RoPE
        context K / V over all layers) ``, nll, perplexity, tokens``.
    """
    ids = jnp.asarray(ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[1] < context_len + eval_len + 1:
        raise ValueError(
            f"ids has shape {ids.shape}; need [batch, >= context_len + eval_len + 1 = "
            f"{context_len + eval_len + 1}] tokens."
        )
    if context_len < 1 or eval_len < 1:
        raise ValueError(f"context_len={context_len} and eval_len={eval_len} must be >= 1.")
    theta = model.cfg.rope_theta
    _, keys, values = _prefill_forward(model, ids[:, :context_len])
    inputs = ids[:, context_len: context_len + eval_len]
    targets = ids[:, context_len + 1: context_len + eval_len + 1]
    positions = jnp.arange(context_len)
    results = []
    for setting in settings:
        method, ratio = setting[:2]
        sink = int(setting[2]) if len(setting) > 2 else sink_tokens
        gs = _method_group_size(method, int(setting[3]) if len(setting) > 3 else group_size)
        if method == "none":
            ctx_k, ctx_v, info = keys, values, dict(compression_ratio=1.0, rank_k=None,
                                                    rank_v=None, key_error=0.0,
                                                    value_error=0.0)
        else:
            cache = xkv_compress(keys, values, rope_theta=theta, ratio=ratio, group_size=gs,
                                 value_rank_scale=value_rank_scale, sink_tokens=sink)
            n = cache.n_layers
            ctx_k = jnp.stack([xkv_reconstruct(cache, l, "k") for l in range(n)])
            ctx_v = jnp.stack([xkv_reconstruct(cache, l, "v") for l in range(n)])
            rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            info = dict(compression_ratio=compression_ratio(cache), rank_k=cache.ranks[0][0],
                        rank_v=cache.ranks[0][1], key_error=rel(ctx_k, keys),
                        value_error=rel(ctx_v, values))
        ctx_k = jax.vmap(lambda k: rope(k, positions, theta))(ctx_k)
        logits = _block_forward(model, inputs, ctx_k, ctx_v.astype(jnp.float32))
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -float(jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)))
        results.append(dict(method=method, target_ratio=None if method == "none" else ratio,
                            sink_tokens=None if method == "none" else sink,
                            group_size=None if method == "none" else gs, nll=nll, perplexity=math.exp(nll), tokens=int(targets.size), **info))
    return results


def xkv_perplexity(
    model, ids, *, context_len: int, eval_len: int, ratio: float = 8.0, method: str = "xkv",
    group_size: int = DEFAULT_GROUP_SIZE, value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
) -> float:
    """Perplexity of ``eval_len`` tokens after a compressed context (see
    :func:`xkv_perplexity_sweep` for the protocol, shared by ``"xkv"``, ``"per_layer_svd"``
    (same ``ratio``, ``G = 1``, so equal memory up to rank rounding) and ``"none"``).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> ids = jnp.arange(64) % 32
        >>> ppl = xkv_perplexity(model, ids, context_len=48, eval_len=8, ratio=2.0,
        ...                      group_size=2)
        >>> ppl > 1.0
        True
    """
    return xkv_perplexity_sweep(model, ids, context_len=context_len, eval_len=eval_len,
                                settings=[(method, ratio)], group_size=group_size,
                                value_rank_scale=value_rank_scale,
                                sink_tokens=sink_tokens)[0]["perplexity"]


# --------------------------------------------------------------------------------------------
# CLI hook
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class XKVCacheFactory:
    """What ``--kv xkv --kv-ratio R [--kv-group G]`` builds: bound settings for a model.

    Example::

        >>> factory = xkv_cache_factory(8.0, 4)
        >>> factory.ratio, factory.group_size
        (8.0, 4)
    """

    ratio: float
    group_size: int = DEFAULT_GROUP_SIZE
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE
    selective: SelectiveConfig | None = None
    sink_tokens: int = DEFAULT_SINK_TOKENS

    def prefill(self, model, tokens, *, max_new_tokens: int = 256) -> XKVCache:
        return xkv_prefill(model, tokens, ratio=self.ratio, group_size=self.group_size,
                           value_rank_scale=self.value_rank_scale, selective=self.selective,
                           max_new_tokens=max_new_tokens, sink_tokens=self.sink_tokens)

    def decode_step(self, model, cache: XKVCache, token):
        return xkv_decode_step(model, cache, token)

    def generate(self, model, prompt, *, max_new_tokens: int):
        return xkv_generate(model, prompt, max_new_tokens=max_new_tokens, ratio=self.ratio,
                            group_size=self.group_size, value_rank_scale=self.value_rank_scale,
                            selective=self.selective, sink_tokens=self.sink_tokens)

    def perplexity(self, model, ids, *, context_len: int, eval_len: int) -> float:
        return xkv_perplexity(model, ids, context_len=context_len, eval_len=eval_len,
                              ratio=self.ratio, group_size=self.group_size,
                              value_rank_scale=self.value_rank_scale,
                              sink_tokens=self.sink_tokens)


def xkv_cache_factory(ratio: float, group_size: int = DEFAULT_GROUP_SIZE,
                      sink_tokens: int = DEFAULT_SINK_TOKENS) -> XKVCacheFactory:
    """The object ``--kv xkv --kv-ratio R --kv-group G --kv-sink S`` maps to (validated).

    Example::

        >>> xkv_cache_factory(4.0).group_size
        4
    """
    if not ratio > 0:
        raise ValueError(f"--kv-ratio={ratio} must be > 0 (e.g. 8).")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (default 4).")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"--kv-sink={sink_tokens!r} must be an int >= 0 (default "
                         f"{DEFAULT_SINK_TOKENS}; 0 = the paper's xKV).")
    return XKVCacheFactory(ratio=float(ratio), group_size=group_size, sink_tokens=sink_tokens)


__all__ = [
    "DEFAULT_GROUP_SIZE", "DEFAULT_SINK_TOKENS", "METHODS", "SelectiveConfig", "SelectiveState", "XKVCache",
    "XKVCacheFactory", "choose_ranks", "compressed_bytes", "compression_ratio", "layer_groups",
    "predicted_compression_ratio", "selective_decode_attention", "uncompressed_bytes",
    "xkv_cache_factory", "xkv_compress", "xkv_decode_step", "xkv_generate", "xkv_perplexity",
    "xkv_perplexity_sweep", "xkv_prefill", "xkv_reconstruct",
]
