"""Grouped LoRA products by XLA: ``jax.lax.ragged_dot`` over tokens sorted by adapter.

.. math::
    \\text{shrink: } h_t = s_{k(t)}\\, x_t A_{k(t)} \\odot m_{k(t)},\\qquad
    \\text{expand: } y_t = \\mathrm{acc}_t + (h_t \\odot m_{k(t)}) B_{k(t)}

where rows ``t`` are contiguous per group ``k`` (``group_sizes[k]`` rows each, in order) and
``m_k = [1]*r_k + [0]*(R - r_k)`` masks the padded rank slots.

References:
    Yan et al, `PLoRA: Efficient LoRA Hyperparameter Tuning for Large Models
    <https://arxiv.org/abs/2508.02932>`_, 2025; Chen et al, `Punica: Multi-Tenant LoRA Serving
    <https://arxiv.org/abs/2310.18547>`_, 2023.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rank_mask(ranks: Int[Array, " k"], r_max: int, dtype=jnp.float32) -> Float[Array, "k r"]:
    """``mask[k, j] = 1`` where ``j < ranks[k]``, else 0."""
    return (jnp.arange(r_max)[None, :] < jnp.asarray(ranks)[:, None]).astype(dtype)


def group_ids(group_sizes: Int[Array, " k"], n: int) -> Int[Array, " n"]:
    """Group index of every row (rows past ``sum(group_sizes)`` get ``K``, i.e. no group)."""
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(n, dtype=jnp.int32), side="right").astype(jnp.int32)


def lora_shrink_reference(
    x: Float[Array, "n d_in"],
    a: Float[Array, "k d_in r"],
    group_sizes: Int[Array, " k"],
    scale: Float[Array, " k"],
    ranks: Int[Array, " k"],
) -> Float[Array, "n r"]:
    """``h = s_k · (x A_k) ⊙ m_k`` per group by ``ragged_dot`` (fp32 accumulation).

    Args:
        x: tokens ``[N, d_in]`` sorted by group; a: ``[K, d_in, R]``.
        group_sizes: int32 ``[K]``, ``sum ≤ N`` (rows past the sum give 0).
        scale: ``[K]`` per-group scale (``alpha_k / r_k``); ranks: int ``[K]`` true ranks ``≤ R``.

    Returns:
        ``[N, R]`` fp32.

    Example::

        >>> import jax.numpy as jnp
        >>> h = lora_shrink_reference(jnp.ones((5, 4)), jnp.ones((2, 4, 3)),
        ...                           jnp.array([2, 3]), jnp.ones(2), jnp.array([1, 3]))
        >>> h[0].tolist(), h[4].tolist()
        ([4.0, 0.0, 0.0], [4.0, 4.0, 4.0])
    """
    k, _, r_max = a.shape
    a = a * rank_mask(ranks, r_max, a.dtype)[:, None, :]
    h = jax.lax.ragged_dot(x, a, jnp.asarray(group_sizes, jnp.int32),
                           preferred_element_type=jnp.float32)
    gid = group_ids(group_sizes, x.shape[0])
    s = jnp.concatenate([jnp.asarray(scale, jnp.float32), jnp.zeros((1,), jnp.float32)])
    return h * s[gid][:, None]


def lora_expand_reference(
    h: Float[Array, "n r"],
    b: Float[Array, "k r d_out"],
    group_sizes: Int[Array, " k"],
    ranks: Int[Array, " k"],
    acc: Float[Array, "n d_out"] | None = None,
) -> Float[Array, "n d_out"]:
    """``y = acc + (h ⊙ m_k) B_k`` per group by ``ragged_dot`` (fp32).

    Args:
        h: ``[N, R]`` (from :func:`lora_shrink_reference`); b: ``[K, R, d_out]``.
        group_sizes: int32 ``[K]``; ranks: int ``[K]``.
        acc: optional ``[N, d_out]`` added to the result (e.g. the base layer's output).

    Returns:
        ``[N, d_out]`` fp32.

    Example::

        >>> import jax.numpy as jnp
        >>> y = lora_expand_reference(jnp.ones((3, 2)), jnp.ones((2, 2, 4)), jnp.array([1, 2]),
        ...                           jnp.array([1, 2]))
        >>> y[:, 0].tolist()
        [1.0, 2.0, 2.0]
    """
    b = b * rank_mask(ranks, b.shape[1], b.dtype)[:, :, None]
    y = jax.lax.ragged_dot(h.astype(b.dtype), b, jnp.asarray(group_sizes, jnp.int32),
                           preferred_element_type=jnp.float32)
    return y if acc is None else y + acc.astype(jnp.float32)


def grouped_lora_loop_reference(x, a, b, group_sizes, scale, ranks):
    """Slice-per-group oracle (Python loop, concrete sizes): ``s_k x_k A_k[:, :r_k] B_k[:r_k]``."""
    out, start = [], 0
    for k, size in enumerate([int(g) for g in group_sizes]):
        rk = int(ranks[k])
        xk = x[start:start + size].astype(jnp.float32)
        out.append(scale[k] * (xk @ a[k, :, :rk]) @ b[k, :rk])
        start += size
    rest = x.shape[0] - start
    out.append(jnp.zeros((rest, b.shape[-1]), jnp.float32))
    return jnp.concatenate(out, axis=0)
