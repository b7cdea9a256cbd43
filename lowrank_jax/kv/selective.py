"""xKV-SR decode attention: rebuild only the prompt chunks a query scores highest (after
ShadowKV)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from lowrank_jax.kv.cache import XKVCache
from pallas_kernels.xkv_decode.reference import NEG_INF


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
        >>> from lowrank_jax.kv.cache import SelectiveConfig
        >>> from lowrank_jax.kv.compress import xkv_compress
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


__all__ = [
    "selective_decode_attention",
]
