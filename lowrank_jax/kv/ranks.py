"""xKV layer grouping and rank selection (how many singular directions a group keeps)."""

from __future__ import annotations

import math

import numpy as np

#: xKV's default number of adjacent layers that share one SVD basis (xKV-4).
DEFAULT_GROUP_SIZE = 4  # xKV-4, the paper's default
DEFAULT_VALUE_RANK_SCALE = 1.5  # r_v / r_k = 576 / 384 in the paper's default setting
# Exact "attention-sink" prompt tokens kept outside the SVD by the model-level entry points
# (DERIVED, not in the paper: on SmolLM2 the first token's reconstruction error dominates the
# perplexity loss; keeping it exact costs one token of cache and closes most of the gap; see
# docs/results/xkv.md). ``xkv_compress`` itself defaults to the paper (0).
#: Prompt tokens kept exact outside the SVD by the model-level entry points.
DEFAULT_SINK_TOKENS = 1


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


def full_rank(tokens: int, group_layers: int, kv_heads: int, head_dim: int) -> int:
    """The largest rank a group of ``group_layers`` layers' K (or V) matrix can have."""
    return min(tokens, group_layers * kv_heads * head_dim)


def check_sink_tokens(sink_tokens, tokens: int) -> None:
    """``ValueError`` unless ``sink_tokens`` is an int in ``[0, tokens)``."""
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
    check_sink_tokens(sink_tokens, tokens)
    features = group_layers * kv_heads * head_dim
    factored = tokens - sink_tokens
    budget = (2 * group_layers * tokens * kv_heads * head_dim / ratio - extra_numbers
              - 2 * sink_tokens * features)
    total = int(math.floor(budget / (factored + features) + 1e-9))
    rank_k = int(math.floor(total / (1.0 + value_rank_scale)))
    rank_v = total - rank_k
    full = full_rank(factored, group_layers, kv_heads, head_dim)
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


__all__ = [
    "DEFAULT_GROUP_SIZE", "DEFAULT_SINK_TOKENS", "DEFAULT_VALUE_RANK_SCALE", "check_sink_tokens",
    "choose_ranks", "full_rank",
    "layer_groups",
    "predicted_compression_ratio",
]
