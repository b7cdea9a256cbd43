"""Pure-jnp ground truth for decode attention over an xKV-compressed KV cache.

The prompt's keys and values of one layer are stored as low-rank factors,

.. math::

    K_h = \\mathrm{RoPE}(A_k B_{k,h}),\\qquad V_h = A_v B_{v,h},

with a token factor ``A`` ``[L, r]`` (shared by a group of layers) and a per-layer, per-KV-head
basis ``B_h`` ``[r, D]``. Tokens generated after the prompt sit in an exact, post-RoPE tail.
One decode query attends to both: ``softmax(q·[K | K_tail]ᵀ/√D)·[V | V_tail]``.

References:
    Chang et al, `xKV: Cross-Layer KV-Cache Compression via Aligned Singular Vector
    Extraction <https://arxiv.org/abs/2503.18893>`_, 2025.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.rope import rope, rope_inverse_frequencies  # the one RoPE (re-exported)

NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: masked rows stay NaN-free


def reconstruct(
    factor: Float[Array, "b L r"], basis: Float[Array, "b hk r d"]
) -> Float[Array, "b L hk d"]:
    """Dense ``A @ B_h`` for every KV head, in fp32."""
    return jnp.einsum(
        "blr,bhrd->blhd", factor.astype(jnp.float32), basis.astype(jnp.float32)
    )


def xkv_decode_reference(
    q: Float[Array, "b hq d"],
    key_factor: Float[Array, "b L rk"],
    key_basis: Float[Array, "b hk rk d"],
    value_factor: Float[Array, "b L rv"],
    value_basis: Float[Array, "b hk rv d"],
    *,
    rope_theta: float,
    tail_keys: Float[Array, "b T hk d"] | None = None,
    tail_values: Float[Array, "b T hk d"] | None = None,
    tail_length=None,
    scale: float | None = None,
    value_path: str = "explicit",
) -> Float[Array, "b hq d"]:
    """Decode attention of one query per sequence over the compressed prompt plus exact tail.

    Rebuilds ``K = RoPE(A_k B_k, 0..L-1)`` densely, then plain fp32 softmax attention. With
    ``value_path="latent"`` the values are accumulated as ``(p·A_v)·B_v`` instead of
    ``p·(A_v B_v)`` (mathematically equal; the kernel uses the latent path).

    Args:
        q: post-RoPE queries of the new token (its position is ``L + tail_length - 1``).
        key_factor, key_basis: pre-RoPE key factors; prompt key ``t`` sits at position ``t``.
        value_factor, value_basis: value factors.
        rope_theta: RoPE base.
        tail_keys, tail_values: exact post-RoPE keys/values of generated tokens (may be None).
        tail_length: how many tail rows are valid (default: all).
        scale: softmax scale (default ``D^-1/2``).
        value_path: ``"explicit"`` or ``"latent"``.

    Returns:
        ``[b, hq, d]`` attention output in fp32.

    Example::

        >>> import jax.numpy as jnp
        >>> out = xkv_decode_reference(jnp.ones((1, 4, 8)), jnp.ones((1, 5, 3)),
        ...     jnp.ones((1, 2, 3, 8)), jnp.ones((1, 5, 3)), jnp.ones((1, 2, 3, 8)),
        ...     rope_theta=1e4)
        >>> out.shape
        (1, 4, 8)
    """
    if value_path not in ("explicit", "latent"):
        raise ValueError(f"value_path={value_path!r} must be 'explicit' or 'latent'.")
    b, hq, d = q.shape
    length = key_factor.shape[1]
    hk = key_basis.shape[1]
    groups = hq // hk
    scale = d ** -0.5 if scale is None else scale
    keys = rope(reconstruct(key_factor, key_basis), jnp.arange(length), rope_theta)
    qg = q.astype(jnp.float32).reshape(b, hk, groups, d)
    logits = jnp.einsum("bhgd,blhd->bhgl", qg, keys) * scale
    if tail_keys is not None:
        t = tail_keys.shape[1]
        tail_length = t if tail_length is None else tail_length
        tail_logits = jnp.einsum("bhgd,bthd->bhgt", qg, tail_keys.astype(jnp.float32)) * scale
        valid = jnp.arange(t) < tail_length
        tail_logits = jnp.where(valid, tail_logits, NEG_INF)
        logits = jnp.concatenate([logits, tail_logits], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    p_prompt = probs[..., :length]
    if value_path == "explicit":
        out = jnp.einsum("bhgl,blhd->bhgd", p_prompt, reconstruct(value_factor, value_basis))
    else:
        latent = jnp.einsum("bhgl,blr->bhgr", p_prompt, value_factor.astype(jnp.float32))
        out = jnp.einsum("bhgr,bhrd->bhgd", latent, value_basis.astype(jnp.float32))
    if tail_keys is not None:
        p_tail = jnp.where(jnp.arange(tail_keys.shape[1]) < tail_length, probs[..., length:], 0.0)
        out = out + jnp.einsum("bhgt,bthd->bhgd", p_tail, tail_values.astype(jnp.float32))
    return out.reshape(b, hq, d)


__all__ = ["NEG_INF", "reconstruct", "rope", "rope_inverse_frequencies", "xkv_decode_reference"]
