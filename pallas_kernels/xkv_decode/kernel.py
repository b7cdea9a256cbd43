"""Pallas kernel: split-K decode attention that rebuilds keys from xKV factors block by block.

Grid ``(batch, kv_heads, splits)``. Program ``(b, h, s)`` walks its ``blocks_per_split`` key
blocks of ``block_k`` prompt tokens with a ``fori_loop``:

.. math::

    K_1 = A_k[\\text{blk}] B_{k,h}^{(1)},\\ K_2 = A_k[\\text{blk}] B_{k,h}^{(2)}\\quad
    (\\text{the two RoPE halves}),\\qquad
    s = \\big(q_1 (K_1 c - K_2 s_n)^\\top + q_2 (K_2 c + K_1 s_n)^\\top\\big)/\\sqrt{D}

then an online softmax (running max ``m``, sum ``l``, fp32) whose value accumulator lives in the
rank-``r_v`` latent space: ``o_lat ← α·o_lat + p·A_v[blk]``. The wrapper merges the splits
(log-sum-exp) and projects ``o_lat·B_{v,h}`` once.

Portable subset only (``pallas_call``, ``BlockSpec``, ``fori_loop``, 2-D iota): the key basis is
split into its two RoPE halves in the wrapper so the kernel never slices a loaded block. For
Triton, every loaded size must be a power of two: the wrapper pads the query-group axis to at
least 16, both ranks to powers of two (zero columns of ``A`` / zero rows of ``B`` change
nothing) and the prompt length to ``splits·blocks·block_k`` (masked).

References:
    Chang et al, `xKV: Cross-Layer KV-Cache Compression via Aligned Singular Vector
    Extraction <https://arxiv.org/abs/2503.18893>`_, 2025.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _dispatch
from pallas_kernels.flash_attention.kernel import compiler_params
from pallas_kernels.rope import rope_inverse_frequencies
from pallas_kernels.xkv_decode.reference import NEG_INF


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_t(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def xkv_decode_kernel(
    q1_ref, q2_ref, inv_freq_ref, ak_ref, bk1_ref, bk2_ref, av_ref,
    o_ref, m_ref, l_ref,
    *, block_k: int, blocks_per_split: int, length: int, scale: float,
):
    """One (batch, kv head, split) program; refs are blocks (see module docstring)."""
    split = pl.program_id(2)
    q1 = q1_ref[...].astype(jnp.float32)  # [g, D/2]
    q2 = q2_ref[...].astype(jnp.float32)
    bk1 = bk1_ref[...].astype(jnp.float32)  # [rk, D/2]
    bk2 = bk2_ref[...].astype(jnp.float32)
    inv_freq = inv_freq_ref[...].astype(jnp.float32)  # [1, D/2]
    g, half = q1.shape
    rv = av_ref.shape[-1]

    def body(i, carry):
        m, l, acc = carry
        start = pl.multiple_of(i * block_k, block_k)
        a = ak_ref[pl.ds(start, block_k), :].astype(jnp.float32)  # [Bk, rk]
        k1, k2 = _dot(a, bk1), _dot(a, bk2)  # [Bk, D/2]
        first = (split * blocks_per_split + i) * block_k
        pos = first + lax.broadcasted_iota(jnp.int32, (block_k, half), 0)
        angles = pos.astype(jnp.float32) * inv_freq
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        r1, r2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        s = (_dot_t(q1, r1) + _dot_t(q2, r2)) * scale  # [g, Bk]
        valid = first + lax.broadcasted_iota(jnp.int32, (g, block_k), 1) < length
        s = jnp.where(valid, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        av = av_ref[pl.ds(start, block_k), :].astype(jnp.float32)  # [Bk, rv]
        acc = alpha * acc + _dot(p, av)
        return m_new, l_new, acc

    init = (  # per-row statistics as [g, 1] columns: legal TPU blocks, no 1-D layouts
        jnp.full((g, 1), NEG_INF, jnp.float32),
        jnp.zeros((g, 1), jnp.float32),
        jnp.zeros((g, rv), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, blocks_per_split, body, init)
    o_ref[...] = acc.astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def default_compiler_params(interpret=False):
    """The backend of the target (:func:`pallas_kernels._dispatch.backend_platform`, which reads
    the abstract mesh when compiling for another platform): **Triton** on GPU, chosen explicitly
    because Mosaic GPU (Pallas' default GPU lowering when no parameters are given) stages whole
    blocks in shared memory (a 4096-token prompt's factors need 3.3 MB > the H100/H200's 227 KB)
    and needs 128-element-multiple copies, while Triton streams the ``pl.ds`` slices of the
    ``fori_loop`` as pointer loads; Mosaic TPU with every grid axis parallel (batch, KV head and
    split are independent); ``None`` in interpret mode."""
    platform = "interpret" if interpret else _dispatch.backend_platform()
    return compiler_params(platform, 3)


@functools.partial(
    jax.jit, static_argnames=("rope_theta", "scale", "block_k", "num_splits", "interpret",
                              "compiler_params")
)
def xkv_decode_partials(
    q, key_factor, key_basis, value_factor, *, rope_theta: float, scale: float,
    block_k: int = 128, num_splits: int = 4, interpret=False, compiler_params=None,
):
    """Run the kernel; return merged latent partials ``(o_lat [b,hk,g,rv], m, l [b,hk,g])``.

    ``o_lat`` is unnormalized (``Σ_t e^{s_t - m} A_v[t]``); ``m`` and ``l`` are the softmax max and
    sum over the prompt. Padding added here is removed before returning. ``compiler_params``
    defaults to :func:`default_compiler_params`.
    """
    if compiler_params is None:
        compiler_params = default_compiler_params(interpret)
    b, hq, d = q.shape
    length, rk = key_factor.shape[1], key_factor.shape[2]
    hk, rv = key_basis.shape[1], value_factor.shape[2]
    groups = hq // hk
    half = d // 2
    gp = max(16, _next_pow2(groups))
    rkp, rvp = _next_pow2(rk), _next_pow2(rv)
    blocks_total = pl.cdiv(length, block_k)
    splits = max(1, min(num_splits, blocks_total))
    blocks_per_split = pl.cdiv(blocks_total, splits)
    padded = splits * blocks_per_split * block_k
    per_split = blocks_per_split * block_k

    qg = q.reshape(b, hk, groups, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - groups), (0, 0)))
    q1, q2 = qg[..., :half], qg[..., half:]
    ak = jnp.pad(key_factor, ((0, 0), (0, padded - length), (0, rkp - rk)))
    av = jnp.pad(value_factor, ((0, 0), (0, padded - length), (0, rvp - rv)))
    bk = jnp.pad(key_basis, ((0, 0), (0, 0), (0, rkp - rk), (0, 0)))
    bk1, bk2 = bk[..., :half], bk[..., half:]
    inv_freq = rope_inverse_frequencies(d, rope_theta)[None, :]

    kernel = functools.partial(
        xkv_decode_kernel, block_k=block_k, blocks_per_split=blocks_per_split,
        length=length, scale=scale,
    )
    sq = pl.Squeezed()
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hk, splits),
        in_specs=[
            pl.BlockSpec((sq, sq, gp, half), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((sq, sq, gp, half), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((1, half), lambda i, h, s: (0, 0)),
            pl.BlockSpec((sq, per_split, rkp), lambda i, h, s: (i, s, 0)),
            pl.BlockSpec((sq, sq, rkp, half), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((sq, sq, rkp, half), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((sq, per_split, rvp), lambda i, h, s: (i, s, 0)),
        ],
        out_specs=[
            pl.BlockSpec((sq, sq, sq, gp, rvp), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((sq, sq, sq, gp, 1), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((sq, sq, sq, gp, 1), lambda i, h, s: (i, h, s, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hk, splits, gp, rvp), jnp.float32),
            jax.ShapeDtypeStruct((b, hk, splits, gp, 1), jnp.float32),
            jax.ShapeDtypeStruct((b, hk, splits, gp, 1), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="xkv_decode",
    )(q1, q2, inv_freq, ak, bk1, bk2, av)
    m, l = m[..., 0], l[..., 0]
    # log-sum-exp merge of the splits
    m_all = jnp.max(m, axis=2)  # [b, hk, gp]
    w = jnp.exp(m - m_all[:, :, None, :])
    l_all = jnp.sum(w * l, axis=2)
    o_all = jnp.sum(w[..., None] * o, axis=2)
    return o_all[:, :, :groups, :rv], m_all[:, :, :groups], l_all[:, :, :groups]


__all__ = ["default_compiler_params", "xkv_decode_kernel", "xkv_decode_partials"]
