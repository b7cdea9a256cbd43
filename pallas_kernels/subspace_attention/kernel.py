"""Dual-stream subspace attention as one Pallas kernel (one online softmax over both streams).

Arrays are head-major and padded by :mod:`pallas_kernels.subspace_attention.api`: ``q, k, v
[B, H, N_pad, D_pad]``, ``q_lat, k_lat [B, H, N_pad, R_pad]``, ``v_lat [B, H, N_pad, RV_pad]``,
``v_basis [H, D_pad, RV_pad]``; ``N_pad`` is a multiple of both block sizes and every feature dim a
power of two ≥ 16 (zero padding changes no dot product).

Grid ``(B, H, nQ)``. Each program holds its query block (exact and projected) and the head's whole
K/V streams, reads its two lookup-table rows, then runs two ``fori_loop``s that share the
fp32 statistics ``m, l``:

1. over the ``near_count`` near key blocks: ``s = c q kᵀ``, ``acc_full += p v``;
2. over the ``far_count`` far key blocks: ``s = c q̃ k̃ᵀ``, ``acc_lat += p ṽ``
   (or ``acc_full += p v`` when ``latent_values=False``, the ``far_exact`` ablation);

every step rescales both accumulators by ``exp(m_old − m_new)``. Finalize:
``o = (acc_full + acc_lat E_vᵀ) / l``. Keys at positions ``≥ n`` are masked in both loops.

Only the portable Pallas subset is used (BlockSpec grid, ``fori_loop`` with a trip count read
from a ref, slices of a full-sequence ref, 2-D iota masks, 2-D dots), the design of the GPU
block-sparse SALE kernel: it lowers to Triton on GPU and runs anywhere in interpret mode.

References:
  Video-SVD (Wan et al., ICML 2026), our interpretation: see the project spec ``video_svd.md``;
  Dao, FlashAttention-2, https://arxiv.org/abs/2307.08691
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.kernel import block_dot, compiler_params
from pallas_kernels.subspace_attention.reference import MASK_VALUE

from pallas_kernels.flash_attention.kernel import PLATFORMS  # noqa: E402 (one list)


def _step(q, kb, vb, col0, acc, m, l, *, scale, n, block_q, block_k):
    """One online-softmax step on a key block; returns ``(p·vb, alpha, m_new, l_new)``."""
    col = col0 + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    valid = col < n
    s = jnp.where(valid, block_dot(q, kb, trans_b=True) * scale, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    return block_dot(p.astype(vb.dtype), vb), alpha, m_new, l_new


def _dual_stream_kernel(near_lut_ref, near_cnt_ref, far_lut_ref, far_cnt_ref, q_ref, k_ref, v_ref,
                        ql_ref, kl_ref, vl_ref, basis_ref, o_ref, *, scale, n, block_q, block_k,
                        latent_values):
    q, q_lat = q_ref[...], ql_ref[...]
    near_count, far_count = near_cnt_ref[0, 0], far_cnt_ref[0, 0]
    step = functools.partial(_step, scale=scale, n=n, block_q=block_q, block_k=block_k)

    def near_body(t, carry):
        acc_full, acc_lat, m, l = carry
        start = pl.multiple_of(near_lut_ref[0, t] * block_k, block_k)
        pv, alpha, m, l = step(q, k_ref[pl.ds(start, block_k), :], v_ref[pl.ds(start, block_k), :],
                               start, acc_full, m, l)
        return alpha * acc_full + pv, alpha * acc_lat, m, l

    def far_body(t, carry):
        acc_full, acc_lat, m, l = carry
        start = pl.multiple_of(far_lut_ref[0, t] * block_k, block_k)
        kb = kl_ref[pl.ds(start, block_k), :]
        if latent_values:
            pv, alpha, m, l = step(q_lat, kb, vl_ref[pl.ds(start, block_k), :], start, acc_lat,
                                   m, l)
            return alpha * acc_full, alpha * acc_lat + pv, m, l
        pv, alpha, m, l = step(q_lat, kb, v_ref[pl.ds(start, block_k), :], start, acc_full, m, l)
        return alpha * acc_full + pv, alpha * acc_lat, m, l

    init = (jnp.zeros((block_q, q.shape[-1]), jnp.float32),
            jnp.zeros((block_q, vl_ref.shape[-1]), jnp.float32),
            jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((block_q, 1), jnp.float32))
    carry = lax.fori_loop(0, near_count, near_body, init)
    acc_full, acc_lat, _, l = lax.fori_loop(0, far_count, far_body, carry)
    if latent_values:
        acc_full = acc_full + block_dot(acc_lat, basis_ref[...].astype(jnp.float32), trans_b=True)
    o_ref[...] = (acc_full / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@functools.partial(
    jax.jit,
    static_argnames=("block_q", "block_k", "n", "scale", "latent_values", "platform",
                     "interpret"),
)
def dual_stream_attention(q, k, v, q_lat, k_lat, v_lat, v_basis, near_lut, near_counts, far_lut,
                          far_counts, *, block_q, block_k, n, scale, latent_values=True,
                          platform="interpret", interpret=True):
    """Run the kernel on padded head-major inputs; returns ``[B, H, N_pad, D_pad]``.

    Args:
      q, k, v: ``[B, H, N_pad, D_pad]``; q_lat, k_lat: ``[B, H, N_pad, R_pad]``;
        v_lat: ``[B, H, N_pad, RV_pad]``; v_basis: ``[H, D_pad, RV_pad]``.
      near_lut, far_lut: int32 ``[nQ, nK]`` key-block ids, the first ``count`` of each row used.
      near_counts, far_counts: int32 ``[nQ]``.
      n: the real sequence length (keys ``≥ n`` are masked).
      latent_values: far blocks accumulate ``ṽ`` (then ``E_vᵀ``) if True, else exact ``v``.
    """
    b, h, n_pad, d = q.shape
    r, rv = q_lat.shape[-1], v_lat.shape[-1]
    n_q = n_pad // block_q
    n_k = near_lut.shape[-1]
    width = _pow2(n_k)  # Triton: every loaded array has a power-of-two size

    def table(lut):
        return jnp.pad(lut.astype(jnp.int32), ((0, 0), (0, width - n_k)))[:, None, :]

    def count(c):
        return c.astype(jnp.int32)[:, None, None]

    kernel = functools.partial(_dual_stream_kernel, scale=scale, n=n, block_q=block_q,
                               block_k=block_k, latent_values=latent_values)
    # The lookup-table rows are read as scalars (loop bounds and block offsets): on TPU they live
    # in SMEM, where a dynamic index needs no alignment proof (a dynamic lane index into a VMEM
    # row does: Mosaic cannot prove it is a multiple of 128).
    space = {}
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        space = {"memory_space": pltpu.SMEM}
    lut_spec = pl.BlockSpec((None, 1, width), lambda bi, hi, qi: (qi, 0, 0), **space)
    cnt_spec = pl.BlockSpec((None, 1, 1), lambda bi, hi, qi: (qi, 0, 0), **space)

    def rows(dim):
        return pl.BlockSpec((None, None, block_q, dim), lambda bi, hi, qi: (bi, hi, qi, 0))

    def full(dim):
        return pl.BlockSpec((None, None, n_pad, dim), lambda bi, hi, qi: (bi, hi, 0, 0))

    basis_spec = pl.BlockSpec((None, d, rv), lambda bi, hi, qi: (hi, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, h, n_q),
        in_specs=[lut_spec, cnt_spec, lut_spec, cnt_spec, rows(d), full(d), full(d), rows(r),
                  full(r), full(rv), basis_spec],
        out_specs=rows(d),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="dual_stream_subspace_attention",
    )(table(near_lut), count(near_counts), table(far_lut), count(far_counts), q, k, v, q_lat,
      k_lat, v_lat, v_basis)


def estimate_flops(n: int, head_dim: int, rank: int, rank_v: int, near_pairs: int,
                   *, latent_values: bool = True) -> dict:
    """Analytic matmul FLOPs of one head: dense vs this kernel (plus the finalize matmul).

    ``near_pairs`` is the number of (query, key) token pairs on the exact stream. Dense attention
    costs ``4 d`` per pair (``q·k`` and ``p·v``); a far pair costs ``2 r + 2 r_v`` (or
    ``2 r + 2 d`` with exact far values). Exponentials are the same in both (one per pair).
    """
    pairs = n * n
    far_pairs = pairs - near_pairs
    far_cost = 2 * rank + (2 * rank_v if latent_values else 2 * head_dim)
    finalize = 2 * n * rank_v * head_dim if latent_values else 0
    dense = 4 * head_dim * pairs
    ours = 4 * head_dim * near_pairs + far_cost * far_pairs + finalize
    return {"dense": dense, "subspace": ours, "ratio": dense / max(ours, 1)}


__all__ = ["PLATFORMS", "dual_stream_attention", "estimate_flops"]
