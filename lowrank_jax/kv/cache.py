"""The xKV cache pytrees (:class:`XKVCache`, selective-reconstruction state) and their byte
accounting."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jaxtyping import Array


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




def _tail_token_bytes(cache: XKVCache) -> int:
    n, b, _, hk, d = cache.tail_keys.shape
    return 2 * n * b * hk * d * cache.tail_keys.dtype.itemsize


def compressed_bytes(cache: XKVCache) -> int:
    """Bytes actually stored: every factor/basis/SR array, plus the filled tail rows.

    Example::

        >>> import jax
        >>> from lowrank_jax.kv.compress import xkv_compress
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


__all__ = [
    "SelectiveConfig", "SelectiveState", "XKVCache", "compressed_bytes", "compression_ratio",
    "uncompressed_bytes",
]
