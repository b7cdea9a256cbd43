"""Pure-jnp ground truth for dual-stream subspace attention (Video-SVD, our interpretation).

Layout follows the other kernels: ``q, k, v [batch, n, heads, head_dim]``; the projected streams
``q_lat, k_lat [batch, n, heads, rank]`` and ``v_lat [batch, n, heads, rank_v]``; the value basis
``v_basis [heads, head_dim, rank_v]`` (orthonormal columns). Attention is bidirectional.

Keys are grouped in blocks of ``block_k`` tokens and queries in blocks of ``block_q``; a boolean
``near_mask [nQ, nK]`` (shared by batch and heads: the "layer-shared" residual window) says which
(query block, key block) pairs use the exact stream. With ``c = head_dim ** -0.5``:

* near pair: logit ``c · q·k``, value ``v`` (the exact / residual stream);
* far pair: logit ``c · q̃·k̃``, value ``ṽ E_vᵀ`` (the subspace stream), or ``v`` when
  ``v_residual="far_exact"``;

and one softmax runs over all keys of a row. Two jnp implementations live here:
:func:`subspace_attention_reference` builds the whole mixed ``[n, n]`` logit matrix (the oracle),
:func:`subspace_attention_blocked` computes the exact stream only on the near blocks (gathered by
lookup table), so its matmul FLOPs really drop: it is the ``implementation="xla"`` path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

#: Large finite negative logit for masked pairs (finite so a fully masked row stays NaN-free).
from pallas_kernels.flash_attention.reference import MASK_VALUE  # noqa: E402 (one value)

V_RESIDUAL_MODES = ("latent", "far_exact")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_subspace_shapes(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask, *, block_q: int,
                          block_k: int, v_residual: str = "latent") -> tuple[int, ...]:
    """Validate the inputs and return ``(b, n, h, d, rank, rank_v)``; raises ``ValueError``."""
    name = "subspace_attention"
    if v_residual not in V_RESIDUAL_MODES:
        raise ValueError(f"{name}: v_residual={v_residual!r}; choose one of {V_RESIDUAL_MODES}.")
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"{name}: q, k, v must share one 4-D shape [batch, n, heads, head_dim]; "
            f"got q{q.shape}, "
            f"k{k.shape}, v{v.shape} (grouped-query attention is not supported: repeat K/V heads)."
        )
    b, n, h, d = q.shape
    if q_lat.ndim != 4 or q_lat.shape[:3] != (b, n, h) or k_lat.shape != q_lat.shape:
        raise ValueError(
            f"{name}: q_lat{q_lat.shape} and k_lat{k_lat.shape} must both be [batch, n, heads, "
            f"rank] with batch, n, heads = {(b, n, h)} (project with the fitted bases first)."
        )
    rank = q_lat.shape[3]
    if v_lat.ndim != 4 or v_lat.shape[:3] != (b, n, h):
        raise ValueError(f"{name}: v_lat{v_lat.shape} must be [batch, n, heads, rank_v] "
                         f"with batch, n, heads = {(b, n, h)}.")
    rank_v = v_lat.shape[3]
    if v_basis.shape != (h, d, rank_v):
        raise ValueError(f"{name}: v_basis{v_basis.shape} must be [heads, head_dim, rank_v] = "
                         f"{(h, d, rank_v)} (the basis v_lat was projected with).")
    want = (_cdiv(n, block_q), _cdiv(n, block_k))
    if near_mask.shape != want:
        raise ValueError(
            f"{name}: near_mask{near_mask.shape} must be [ceil(n/block_q), ceil(n/block_k)] = "
            f"{want} for n={n}, block_q={block_q}, block_k={block_k}; build it with the same "
            "block sizes."
        )
    return b, n, h, d, rank, rank_v


def token_near_mask(near_mask: Bool[Array, "nq nk"], n: int, block_q: int, block_k: int,
                    n_cols: int | None = None) -> Bool[Array, "n m"]:
    """Expand a block mask to the ``[n, n_cols]`` token mask (row ``i`` → block
    ``i // block_q``)."""
    rows = jnp.arange(n) // block_q
    cols = jnp.arange(n if n_cols is None else n_cols) // block_k
    return jnp.asarray(near_mask, bool)[rows[:, None], cols[None, :]]


def subspace_attention_reference(
    q: Float[Array, "b n h d"],
    k: Float[Array, "b n h d"],
    v: Float[Array, "b n h d"],
    q_lat: Float[Array, "b n h r"],
    k_lat: Float[Array, "b n h r"],
    v_lat: Float[Array, "b n h rv"],
    v_basis: Float[Array, "h d rv"],
    near_mask: Bool[Array, "nq nk"],
    *,
    block_q: int,
    block_k: int,
    scale: float | None = None,
    v_residual: str = "latent",
) -> Float[Array, "b n h d"]:
    """Dual-stream attention computed densely in fp32 (the oracle).

    .. math:: S_{ij} = c\\,\\begin{cases} q_i\\cdot k_j & (i,j)\\ \\text{near}\\\\
       \\tilde q_i\\cdot\\tilde k_j & \\text{far}\\end{cases},\\qquad
       O = P_{\\text{near}} V + (P_{\\text{far}} \\tilde V) E_v^\\top,\\quad P=\\mathrm{softmax}(S).

    Args:
      q, k, v: ``[batch, n, heads, head_dim]``.
      q_lat, k_lat: projected queries/keys ``[batch, n, heads, rank]``.
      v_lat: projected values ``[batch, n, heads, rank_v]``.
      v_basis: ``[heads, head_dim, rank_v]``, maps latent values back.
      near_mask: ``[ceil(n/block_q), ceil(n/block_k)]`` bool, True = exact stream.
      block_q, block_k: token block sizes the mask is defined on.
      scale: logit scale ``c`` (default ``head_dim ** -0.5``), used by both streams.
      v_residual: ``"latent"`` (far values ``ṽ E_vᵀ``) or ``"far_exact"`` (far values ``v``).

    Returns:
      ``[batch, n, heads, head_dim]`` in ``q.dtype``.

    Example::

        >>> import jax.numpy as jnp
        >>> x = jnp.ones((1, 6, 1, 4)); lat = jnp.ones((1, 6, 1, 2))
        >>> basis = jnp.eye(4)[None, :, :2]
        >>> subspace_attention_reference(x, x, x, lat, lat, lat, basis, jnp.ones((2, 2), bool),
        ...                              block_q=4, block_k=4).shape
        (1, 6, 1, 4)
    """
    b, n, h, d, _, _ = check_subspace_shapes(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask,
                                             block_q=block_q, block_k=block_k,
                                             v_residual=v_residual)
    scale = d ** -0.5 if scale is None else float(scale)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    exact = jnp.einsum("bqhd,bkhd->bhqk", f32(q), f32(k)) * scale
    approx = jnp.einsum("bqhr,bkhr->bhqk", f32(q_lat), f32(k_lat)) * scale
    near = token_near_mask(near_mask, n, block_q, block_k)
    probs = jax.nn.softmax(jnp.where(near, exact, approx), axis=-1)
    p_near = jnp.where(near, probs, 0.0)
    p_far = probs - p_near
    out = jnp.einsum("bhqk,bkhd->bqhd", p_near, f32(v))
    if v_residual == "far_exact":
        out = out + jnp.einsum("bhqk,bkhd->bqhd", p_far, f32(v))
    else:
        lat = jnp.einsum("bhqk,bkhr->bqhr", p_far, f32(v_lat))
        out = out + jnp.einsum("bqhr,hdr->bqhd", lat, f32(v_basis))
    return out.astype(q.dtype)


def lookup_tables(near_mask: Bool[Array, "nq nk"]) -> tuple[Int[Array, "nq nk"], ...]:
    """``(near_lut, near_counts, far_lut, far_counts)`` int32 from a block mask.

    Row ``i`` of ``near_lut`` lists the near key blocks of query block ``i`` first (ascending);
    slots past ``near_counts[i]`` repeat the last listed id (or 0). Same for the far blocks.
    """
    near_mask = jnp.asarray(near_mask, bool)
    n_k = near_mask.shape[-1]
    slot = jnp.arange(n_k)[None, :]

    def table(selected):
        order = jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)
        counts = jnp.sum(selected, axis=-1).astype(jnp.int32)
        last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[:, None], axis=-1)
        return jnp.where(slot < counts[:, None], order, last), counts

    near_lut, near_counts = table(near_mask)
    far_lut, far_counts = table(~near_mask)
    return near_lut, near_counts, far_lut, far_counts


def subspace_attention_blocked(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask, *, block_q: int,
                               block_k: int, scale: float | None = None,
                               v_residual: str = "latent", max_near: int | None = None):
    """Same result as :func:`subspace_attention_reference`, exact stream on near blocks only.

    The subspace logits ``c q̃ k̃ᵀ`` are computed for all pairs (``2 n² r`` FLOPs); the exact
    logits only for the ``max_near`` key blocks gathered per query block
    (``2 n · max_near · block_k · d``); one softmax over the merged row. ``max_near`` (static)
    defaults to the mask's largest row count and must be at least that. ``near_mask`` must be
    concrete when ``max_near`` is ``None``.
    """
    b, n, h, d, _, _ = check_subspace_shapes(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask,
                                             block_q=block_q, block_k=block_k,
                                             v_residual=v_residual)
    scale = d ** -0.5 if scale is None else float(scale)
    n_q, n_k = near_mask.shape
    near_lut, near_counts, _, _ = lookup_tables(near_mask)
    if max_near is None:
        max_near = max(int(jnp.max(near_counts)), 1)
    n_pad_q, n_pad_k = n_q * block_q, n_k * block_k
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def pad(x, to):
        return jnp.pad(f32(x), ((0, 0), (0, to - n), (0, 0), (0, 0)))

    qb = pad(q, n_pad_q).reshape(b, n_q, block_q, h, d)
    kb = pad(k, n_pad_k).reshape(b, n_k, block_k, h, d)
    vb = pad(v, n_pad_k).reshape(b, n_k, block_k, h, d)
    lut = near_lut[:, :max_near]  # [nQ, M]
    valid_slot = jnp.arange(max_near)[None, :] < near_counts[:, None]  # [nQ, M]
    k_near = kb[:, lut]  # [b, nQ, M, bk, h, d]
    v_near = vb[:, lut]
    s_near = jnp.einsum("bqihd,bqmjhd->bhqimj", qb, k_near) * scale
    key_pos = lut[:, :, None] * block_k + jnp.arange(block_k)[None, None, :]  # [nQ, M, bk]
    ok_near = valid_slot[:, :, None] & (key_pos < n)
    ok_near = ok_near[None, None, :, None]  # -> [1, 1, nQ, 1, M, bk]
    s_near = jnp.where(ok_near, s_near, MASK_VALUE)
    # subspace logits for every pair; near pairs are masked out of this stream
    s_far = jnp.einsum("bqhr,bkhr->bhqk", pad(q_lat, n_pad_q), pad(k_lat, n_pad_k)) * scale
    far_tok = ~token_near_mask(near_mask, n_pad_q, block_q, block_k, n_pad_k)
    far_tok = far_tok & (jnp.arange(n_pad_k) < n)[None, :]
    s_far = jnp.where(far_tok, s_far, MASK_VALUE).reshape(b, h, n_q, block_q, n_pad_k)
    m = jnp.maximum(jnp.max(s_near, axis=(-2, -1)), jnp.max(s_far, axis=-1))  # [b, h, nQ, bq]
    p_near = jnp.where(ok_near, jnp.exp(s_near - m[..., None, None]), 0.0)
    p_far = jnp.where(far_tok.reshape(n_q, block_q, n_pad_k)[None, None],
                      jnp.exp(s_far - m[..., None]), 0.0)
    denom = jnp.sum(p_near, axis=(-2, -1)) + jnp.sum(p_far, axis=-1)  # [b, h, nQ, bq]
    out = jnp.einsum("bhqimj,bqmjhd->bqihd", p_near, v_near)
    if v_residual == "far_exact":
        out = out + jnp.einsum("bhqik,bkhd->bqihd", p_far, pad(v, n_pad_k))
    else:
        lat = jnp.einsum("bhqik,bkhr->bqihr", p_far, pad(v_lat, n_pad_k))
        out = out + jnp.einsum("bqihr,hdr->bqihd", lat, f32(v_basis))
    out = out / jnp.transpose(denom, (0, 2, 3, 1))[..., None]
    return out.reshape(b, n_pad_q, h, d)[:, :n].astype(q.dtype)


__all__ = ["MASK_VALUE", "V_RESIDUAL_MODES", "check_subspace_shapes", "lookup_tables",
           "subspace_attention_blocked", "subspace_attention_reference", "token_near_mask"]
