"""The attention dispatcher: one signature, several implementations.

Every implementation takes ``q [batch, q_len, heads, head_dim]`` and ``k, v [batch, kv_len,
kv_heads, head_dim]`` (grouped-query attention when ``kv_heads < heads``) and returns
``[batch, q_len, heads, head_dim]``. Query ``i`` sits at absolute position ``q_offset + i``; with
``causal=True`` it sees keys ``j <= q_offset + i``, and only keys ``j < kv_length`` are valid (the
rest of a preallocated KV cache is ignored).

Kernels register themselves with :func:`register_attention`; ``"reference"`` is always there.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

_IMPLEMENTATIONS: dict[str, Callable] = {}
_LAZY: dict[str, str] = {
    # name -> module that calls register_attention(name, ...) when imported
    "flash": "pallas_kernels.flash_attention.api",
    "sale": "pallas_kernels.sparse_attention.api",
}


def register_attention(name: str, fn: Callable) -> None:
    """Make ``fn`` selectable as ``attention=name`` in model configs."""
    _IMPLEMENTATIONS[name] = fn


def available() -> list[str]:
    return sorted(set(_IMPLEMENTATIONS) | set(_LAZY))


def attention_mask(q_len: int, kv_len: int, *, causal: bool, q_offset=0, kv_length=None):
    """Boolean ``[q_len, kv_len]`` mask of the keys each query may attend to."""
    q_pos = q_offset + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), bool)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if kv_length is not None:
        mask = mask & (k_pos < kv_length)
    return mask


def reference_attention(
    q: Float[Array, "b tq h d"],
    k: Float[Array, "b tk hk d"],
    v: Float[Array, "b tk hk d"],
    *,
    causal: bool = True,
    q_offset=0,
    kv_length=None,
    scale: float | None = None,
) -> Float[Array, "b tq h d"]:
    """Plain softmax attention in fp32 (the ground truth every kernel is tested against)."""
    b, tq, h, d = q.shape
    hk = k.shape[2]
    if h % hk:
        raise ValueError(f"attention: {h} query heads are not a multiple of {hk} KV heads.")
    groups = h // hk
    scale = d ** -0.5 if scale is None else scale
    qg = q.reshape(b, tq, hk, groups, d).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32)) * scale
    mask = attention_mask(tq, k.shape[1], causal=causal, q_offset=q_offset, kv_length=kv_length)
    logits = jnp.where(mask, logits, -1e30)  # finite: fully masked rows stay NaN-free
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # rows with no valid key give 0, not NaN
    out = jnp.einsum("bkgqt,btkd->bqkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, tq, h, d).astype(q.dtype)


register_attention("reference", reference_attention)


def get_attention(name: str) -> Callable:
    """The implementation registered under ``name`` (importing its kernel module on first use)."""
    if name not in _IMPLEMENTATIONS and name in _LAZY:
        import importlib

        importlib.import_module(_LAZY[name])
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"Unknown attention implementation {name!r}; choose from {available()}.")
    return _IMPLEMENTATIONS[name]


__all__ = ["attention_mask", "available", "get_attention", "reference_attention",
           "register_attention"]
