"""The one attention reference: pure-jnp softmax attention, ground truth of every attention kernel.

It is the flash kernel's CPU / ``"xla"`` path and ``lowrank_jax.attention``'s ``"reference"``
implementation (the library imports it from here; kernels never import the library).

Layout follows the attention dispatcher: ``q [batch, q_len, heads, head_dim]``, ``k, v [batch,
kv_len, kv_heads, head_dim]`` with ``heads % kv_heads == 0`` (grouped-query attention). Query
``i`` sits at absolute position ``q_offset + i``; with ``causal=True`` it sees keys
``j <= q_offset + i``, and only keys ``j < kv_length`` are valid (the rest of a preallocated KV
cache is ignored).
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


def attention_mask(q_len: int, kv_len: int, *, causal: bool, q_offset=0, kv_length=None,
                   window: int | None = None):
    """Boolean ``[q_len, kv_len]`` mask of the keys each query may attend to.

    ``window`` (sliding-window attention, as Mistral / Gemma 2 / Gemma 3 local layers): query at
    position ``p`` sees only keys ``j > p - window``, i.e. itself and the ``window - 1`` before it.

    Example::

        >>> attention_mask(2, 3, causal=True, q_offset=1).astype(int).tolist()
        [[1, 1, 0], [1, 1, 1]]
        >>> attention_mask(3, 3, causal=True, window=2).astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    q_pos = q_offset + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), bool)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if kv_length is not None:
        mask = mask & (k_pos < kv_length)
    if window is not None:
        check_window(window)
        mask = mask & (k_pos > q_pos - window)
    return mask


def check_window(window) -> None:
    """Refuse a sliding window that is not a positive integer."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"attention: window={window!r} must be a positive integer (the number of "
                         "keys a query sees, itself included) or None for full attention.")


def check_segment_ids(segment_ids, b: int, tq: int, tk: int, *, name: str = "attention"):
    """Validate ``segment_ids = (q_segments [b, tq], kv_segments [b, tk])`` and return the pair."""
    if not (isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2):
        raise ValueError(f"{name}: segment_ids must be a pair (q_segments [batch, q_len], "
                         f"kv_segments [batch, kv_len]); got {type(segment_ids).__name__}.")
    q_seg, kv_seg = segment_ids
    if tuple(q_seg.shape) != (b, tq) or tuple(kv_seg.shape) != (b, tk):
        raise ValueError(f"{name}: segment_ids shapes {tuple(q_seg.shape)}, {tuple(kv_seg.shape)} "
                         f"must be ({b}, {tq}) and ({b}, {tk}) (batch, q_len) / (batch, kv_len).")
    return q_seg, kv_seg


def full_mask(b: int, tq: int, tk: int, *, causal: bool, q_offset=0, kv_length=None,
              window=None, segment_ids=None):
    """The ``[b or 1, tq, tk]`` mask: :func:`attention_mask` and, with packed rows, equal segments.

    Example::

        >>> seg = jnp.array([[0, 0, 1]])
        >>> full_mask(1, 3, 3, causal=True, segment_ids=(seg, seg)).astype(int)[0].tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    mask = attention_mask(tq, tk, causal=causal, q_offset=q_offset, kv_length=kv_length,
                          window=window)[None]
    if segment_ids is not None:
        q_seg, kv_seg = check_segment_ids(segment_ids, b, tq, tk)
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
    return mask


def soft_cap(logits, cap: float | None):
    """Gemma 2's logit soft-cap ``cap · tanh(logits / cap)`` (identity when ``cap`` is None)."""
    if cap is None:
        return logits
    if not cap > 0:
        raise ValueError(f"attention: logit_softcap={cap!r} must be > 0 or None.")
    return cap * jnp.tanh(logits / cap)


def _grouped_logits(q, k, scale):
    b, tq, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, tq, hk, h // hk, d).astype(jnp.float32)
    return jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32)) * scale  # [b,hk,g,tq,tk]


def attention_reference(
    q: Float[Array, "b tq h d"],
    k: Float[Array, "b tk hk d"],
    v: Float[Array, "b tk hk d"],
    *,
    causal: bool = True,
    q_offset=0,
    kv_length=None,
    scale: float | None = None,
    window: int | None = None,
    logit_softcap: float | None = None,
    segment_ids=None,
) -> Float[Array, "b tq h d"]:
    """Softmax attention computed densely in fp32 (the ground truth every kernel is tested against).

    .. math:: O_i = \\sum_j \\mathrm{softmax}_j(c\\, q_i \\cdot k_j + M_{ij})\\, v_j,
       \\quad M_{ij} = -\\infty \\text{ if } j > q_{\\text{offset}} + i \\text{ (causal) or }
       j \\ge \\text{kv\\_length}.

    A query row with no valid key gives 0 (never NaN).

    Args:
      q: queries ``[batch, q_len, heads, head_dim]``.
      k: keys ``[batch, kv_len, kv_heads, head_dim]``.
      v: values, same shape as ``k``.
      causal: mask keys after the query position.
      q_offset: absolute position of query 0 (int or traced scalar).
      kv_length: number of valid keys (default all).
      scale: logit scale ``c``; ``head_dim ** -0.5`` when ``None``.
      window: sliding window: query ``p`` sees keys ``j > p - window`` only (None: all).
      logit_softcap: ``cap · tanh(logit / cap)`` on the scaled logits before the mask (Gemma 2).
      segment_ids: ``(q_segments [b, tq], kv_segments [b, tk])`` integer ids of packed
        documents; a query sees only keys of its own segment.

    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.

    Example::

        >>> import jax.numpy as jnp
        >>> q = jnp.ones((1, 4, 2, 8)); k = v = jnp.ones((1, 4, 1, 8))
        >>> attention_reference(q, k, v).shape
        (1, 4, 2, 8)

    References:
      Dao et al., FlashAttention-2, https://arxiv.org/abs/2307.08691
    """
    b, tq, tk, h, hk, d = check_attention_shapes(q, k, v, name="attention")
    scale = d ** -0.5 if scale is None else scale
    logits = soft_cap(_grouped_logits(q, k, scale), logit_softcap)
    mask = full_mask(b, tq, tk, causal=causal, q_offset=q_offset, kv_length=kv_length,
                     window=window, segment_ids=segment_ids)[:, None, None]  # [b|1,1,1,tq,tk]
    logits = jnp.where(mask, logits, MASK_VALUE)  # finite: fully masked rows stay NaN-free
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # rows with no valid key give 0, not NaN
    out = jnp.einsum("bkgqt,btkd->bqkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, tq, h, d).astype(q.dtype)


def flash_attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None):
    """:func:`attention_reference` with queries and keys both starting at position 0."""
    return attention_reference(q, k, v, causal=causal, scale=scale)


def flash_attention_reference_with_lse(q, k, v, *, causal: bool = True, scale=None):
    """:func:`attention_reference`'s output and the fp32 log-sum-exp ``[b, h, tq]`` of each row."""
    b, tq, tk, h, hk, d = check_attention_shapes(q, k, v)
    scale = d ** -0.5 if scale is None else float(scale)
    logits = _grouped_logits(q, k, scale)
    mask = attention_mask(tq, tk, causal=causal)
    lse = jax.nn.logsumexp(jnp.where(mask, logits, MASK_VALUE), axis=-1).reshape(b, h, tq)
    return attention_reference(q, k, v, causal=causal, scale=scale), lse


__all__ = ["MASK_VALUE", "attention_logits_reference", "attention_mask", "attention_reference",
           "check_attention_shapes", "check_segment_ids", "check_window",
           "flash_attention_reference",
           "flash_attention_reference_with_lse", "full_mask", "soft_cap"]
