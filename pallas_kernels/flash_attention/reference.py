"""Pure-jnp ground truth for the flash-attention kernel (also the CPU / ``"xla"`` path).

Layout follows the attention dispatcher: ``q [batch, q_len, heads, head_dim]``, ``k, v [batch,
kv_len, kv_heads, head_dim]`` with ``heads % kv_heads == 0`` (grouped-query attention). With
``causal=True`` query ``i`` attends to keys ``j <= i`` (queries and keys start at position 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

#: Large finite negative logit for masked pairs (finite so a fully masked row stays NaN-free).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_attention_shapes(q, k, v, *, name: str = "flash_attention") -> tuple[int, ...]:
    """Validate ``q [b,tq,h,d]``, ``k, v [b,tk,hk,d]`` and return ``(b, tq, tk, h, hk, d)``."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{name}: q, k, v must be 4-D [batch, seq, heads, head_dim]; got q{q.shape}, "
            f"k{k.shape}, v{v.shape}."
        )
    b, tq, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{name}: k{k.shape} and v{v.shape} must have the same shape.")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            f"{name}: k{k.shape} must share batch and head_dim with q{q.shape} "
            "(layout [batch, seq, heads, head_dim])."
        )
    hk = k.shape[2]
    if h % hk:
        raise ValueError(
            f"{name}: q has {h} heads, which is not a multiple of the {hk} KV heads in k{k.shape}; "
            "grouped-query attention needs heads % kv_heads == 0."
        )
    return b, tq, k.shape[1], h, hk, d


def attention_logits_reference(q, k, *, scale: float) -> Float[Array, "b h tq tk"]:
    """fp32 logits ``scale · q kᵀ`` per query head (KV heads repeated for GQA)."""
    b, tq, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, tq, hk, h // hk, d).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32)) * scale
    return logits.reshape(b, h, tq, k.shape[1])


def flash_attention_reference(
    q: Float[Array, "b tq h d"],
    k: Float[Array, "b tk hk d"],
    v: Float[Array, "b tk hk d"],
    *,
    causal: bool = True,
    scale: float | None = None,
) -> Float[Array, "b tq h d"]:
    """Softmax attention computed densely in fp32.

    .. math:: O_i = \\sum_j \\mathrm{softmax}_j(c\\, q_i \\cdot k_j + M_{ij})\\, v_j,
       \\quad M_{ij} = -\\infty \\text{ if causal and } j > i.

    Args:
      q: queries ``[batch, q_len, heads, head_dim]``.
      k: keys ``[batch, kv_len, kv_heads, head_dim]``.
      v: values, same shape as ``k``.
      causal: mask keys after the query position.
      scale: logit scale ``c``; ``head_dim ** -0.5`` when ``None``.

    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.

    Example::

        >>> import jax.numpy as jnp
        >>> q = jnp.ones((1, 4, 2, 8)); k = v = jnp.ones((1, 4, 1, 8))
        >>> flash_attention_reference(q, k, v).shape
        (1, 4, 2, 8)

    References:
      Dao et al., FlashAttention-2, https://arxiv.org/abs/2307.08691
    """
    out, _ = flash_attention_reference_with_lse(q, k, v, causal=causal, scale=scale)
    return out


def flash_attention_reference_with_lse(q, k, v, *, causal: bool = True, scale=None):
    """Reference output and the fp32 log-sum-exp ``[b, h, tq]`` of every row's logits."""
    b, tq, tk, h, hk, d = check_attention_shapes(q, k, v)
    scale = d ** -0.5 if scale is None else float(scale)
    logits = attention_logits_reference(q, k, scale=scale)
    if causal:
        mask = jnp.arange(tk)[None, :] <= jnp.arange(tq)[:, None]
        logits = jnp.where(mask, logits, MASK_VALUE)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    vg = jnp.repeat(v.astype(jnp.float32), h // hk, axis=2)  # [b, tk, h, d]
    out = jnp.einsum("bhqt,bthd->bqhd", probs, vg)
    return out.astype(q.dtype), lse


__all__ = ["MASK_VALUE", "check_attention_shapes", "attention_logits_reference",
           "flash_attention_reference", "flash_attention_reference_with_lse"]
