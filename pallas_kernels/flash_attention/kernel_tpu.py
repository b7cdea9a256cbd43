"""Streaming flash-attention kernels for TPU (Mosaic): K/V (backward: Q) block by block.

The portable kernels of :mod:`pallas_kernels.flash_attention.kernel` keep one head's whole K/V
sequence in VMEM and loop over it, the layout Triton wants; on a TPU that caps the sequence at
what VMEM holds. These kernels stream instead, like JAX's TPU flash attention: the grid is
``(b, h, nQ, nK)`` (dk/dv: ``(b, h, nK, nQ)``) with the last axis ``"arbitrary"``, the running
statistics and accumulators live in VMEM scratch (statistics lane-replicated, ``[block, 128]``),
and the output block is written on the last step. Blocks outside the causal range or the
sliding window are skipped twice: their index map repeats the last needed block (no DMA) and
``pl.when`` skips the compute. Same contract, masks and padded layouts as the portable kernels
(:class:`~pallas_kernels.flash_attention.kernel.Masks`, ``segment_layouts``); no sequence-length
limit from VMEM.

References:
  Dao, FlashAttention-2, https://arxiv.org/abs/2307.08691
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.kernel import (
    Masks,
    block_dot,
    block_logits,
    dlogits,
    kv_block_range,
    pair_mask,
    q_block_range,
    split_refs,
)
from pallas_kernels.flash_attention.reference import MASK_VALUE

_LANES = 128


def _params(interpret):
    if interpret:
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _scratch(*shapes):
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM(shape, jnp.float32) for shape in shapes]


def _clamp(i, lower, upper):
    """Block ``i`` clamped to ``[lower, upper - 1]``: a skipped step re-reads a needed block."""
    return jnp.maximum(jnp.minimum(i, upper - 1), lower)


def _fwd_kernel(*refs, scale, block_q, block_k, masks: Masks):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, rest = split_refs(refs, 3, masks)
    o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    qi, j, nk = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    lower, upper = kv_block_range(qi, block_q, block_k, masks)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(jnp.logical_and(j >= lower, j < upper))
    def _step():
        kb, vb = k_ref[...], v_ref[...]
        s, _ = block_logits(q_ref[...], kb, scale, masks)
        mask = pair_mask(qi * block_q, j * block_k, (block_q, block_k), masks,
                      qs_ref[...] if masks.segments else None,
                      ks_ref[...] if masks.segments else None)
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev, l_prev = m_sc[...][:, :1], l_sc[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + block_dot(p.astype(vb.dtype), vb)
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(j == nk - 1)
    def _write():
        l = l_sc[...][:, :1]
        l_safe = jnp.where(l == 0.0, 1.0, l)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...][:, :1] + jnp.log(l_safe)


def _kv_index(block_q, block_k, masks, groups):
    """Index map of a K/V-side block on the ``(b, h, qi, j)`` grid (clamped to needed blocks)."""
    def index(bi, hi, qi, j):
        lower, upper = kv_block_range(qi, block_q, block_k, masks)
        return bi, hi // groups, _clamp(j, lower, upper), 0
    return index


def _segment_specs_q_major(masks, block_q, block_k):
    if not masks.segments:
        return []

    def kv_seg(bi, hi, qi, j):
        lower, upper = kv_block_range(qi, block_q, block_k, masks)
        return bi, _clamp(j, lower, upper), 0, 0

    return [pl.BlockSpec((None, block_q, 1), lambda bi, hi, qi, j: (bi, qi, 0)),
            pl.BlockSpec((None, None, 1, block_k), kv_seg)]


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "masks",
                                             "interpret"))
def flash_forward_tpu(q, k, v, segments=(), *, scale, block_q, block_k, masks: Masks,
                      interpret=False):
    """Forward on padded ``[b, h, t, d]`` arrays: output and lse ``[b, h, tq_pad, 1]``."""
    b, h, tq_pad, d = q.shape
    hk, tk_pad = k.shape[1], k.shape[2]
    groups = h // hk
    q_spec = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, d), _kv_index(block_q, block_k, masks, groups))
    lse_spec = pl.BlockSpec((None, None, block_q, 1), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, block_q=block_q, block_k=block_k,
                          masks=masks),
        grid=(b, h, tq_pad // block_q, tk_pad // block_k),
        in_specs=[q_spec, kv_spec, kv_spec] + _segment_specs_q_major(masks, block_q, block_k),
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, tq_pad, 1), jnp.float32)],
        scratch_shapes=_scratch((block_q, _LANES), (block_q, _LANES), (block_q, d)),
        compiler_params=_params(interpret),
        interpret=interpret,
        name="flash_attention_fwd_tpu",
    )(q, k, v, *segments)


def _dq_kernel(*refs, scale, block_q, block_k, masks: Masks):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, rest = split_refs(
        refs, 6, masks)
    dq_ref, dq_sc = rest
    qi, j, nk = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    lower, upper = kv_block_range(qi, block_q, block_k, masks)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(jnp.logical_and(j >= lower, j < upper))
    def _step():
        kb, vb = k_ref[...], v_ref[...]
        s, t = block_logits(q_ref[...], kb, scale, masks)
        mask = pair_mask(qi * block_q, j * block_k, (block_q, block_k), masks,
                      qs_ref[...] if masks.segments else None,
                      ks_ref[...] if masks.segments else None)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
        dp = block_dot(do_ref[...], vb, trans_b=True)
        ds = dlogits(p, dp, delta_ref[...], t)
        dq_sc[...] += block_dot(ds.astype(kb.dtype), kb)

    @pl.when(j == nk - 1)
    def _write():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, block_q, block_k, masks: Masks):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, rest = split_refs(
        refs, 6, masks)
    dk_ref, dv_ref, dk_sc, dv_sc = rest
    kj, i, nq = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    lower, upper = q_block_range(kj, block_q, block_k, nq, masks)

    @pl.when(i == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(jnp.logical_and(i >= lower, i < upper))
    def _step():
        qb, dob, kb, vb = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        s, t = block_logits(qb, kb, scale, masks)
        mask = pair_mask(i * block_q, kj * block_k, (block_q, block_k), masks,
                      qs_ref[...] if masks.segments else None,
                      ks_ref[...] if masks.segments else None)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
        dv_sc[...] += block_dot(p.astype(dob.dtype), dob, trans_a=True)
        dp = block_dot(dob, vb, trans_b=True)
        ds = dlogits(p, dp, delta_ref[...], t)
        dk_sc[...] += block_dot(ds.astype(qb.dtype), qb, trans_a=True)

    @pl.when(i == nq - 1)
    def _write():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "masks",
                                             "interpret"))
def flash_backward_tpu(q, k, v, out, lse, d_out, segments=(), *, scale, block_q, block_k,
                       masks: Masks, interpret=False):
    """Backward: ``(dq, dk, dv)`` in the padded layout (dk, dv summed over GQA groups)."""
    b, h, tq_pad, d = q.shape
    hk, tk_pad = k.shape[1], k.shape[2]
    groups, n_q, n_k = h // hk, tq_pad // block_q, tk_pad // block_k
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    d_out = d_out.astype(q.dtype)
    statics = dict(scale=scale, block_q=block_q, block_k=block_k, masks=masks)

    q_rows = pl.BlockSpec((None, None, block_q, d), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    kv_cols = pl.BlockSpec((None, None, block_k, d), _kv_index(block_q, block_k, masks, groups))
    stat_rows = pl.BlockSpec((None, None, block_q, 1), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid=(b, h, n_q, n_k),
        in_specs=[q_rows, kv_cols, kv_cols, q_rows, stat_rows, stat_rows]
        + _segment_specs_q_major(masks, block_q, block_k),
        out_specs=q_rows,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        scratch_shapes=_scratch((block_q, d)),
        compiler_params=_params(interpret),
        interpret=interpret,
        name="flash_attention_dq_tpu",
    )(q, k, v, d_out, lse, delta, *segments)

    def q_index(bi, hi, kj, i):
        lower, upper = q_block_range(kj, block_q, block_k, n_q, masks)
        return bi, hi, _clamp(i, lower, upper), 0

    def q_seg_index(bi, hi, kj, i):
        return q_index(bi, hi, kj, i)[0], q_index(bi, hi, kj, i)[2], 0

    q_blk = pl.BlockSpec((None, None, block_q, d), q_index)
    stat_blk = pl.BlockSpec((None, None, block_q, 1), q_index)
    kv_rows = pl.BlockSpec((None, None, block_k, d), lambda bi, hi, kj, i: (bi, hi // groups,
                                                                               kj, 0))
    dkv_out = pl.BlockSpec((None, None, block_k, d), lambda bi, hi, kj, i: (bi, hi, kj, 0))
    seg_specs = []
    if masks.segments:
        seg_specs = [pl.BlockSpec((None, block_q, 1), q_seg_index),
                     pl.BlockSpec((None, None, 1, block_k), lambda bi, hi, kj, i: (bi, kj, 0, 0))]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **statics),
        grid=(b, h, n_k, n_q),
        in_specs=[q_blk, kv_rows, kv_rows, q_blk, stat_blk, stat_blk] + seg_specs,
        out_specs=[dkv_out, dkv_out],
        out_shape=[jax.ShapeDtypeStruct((b, h, tk_pad, d), jnp.float32)] * 2,
        scratch_shapes=_scratch((block_k, d), (block_k, d)),
        compiler_params=_params(interpret),
        interpret=interpret,
        name="flash_attention_dkv_tpu",
    )(q, k, v, d_out, lse, delta, *segments)
    dk = dk.reshape(b, hk, groups, tk_pad, d).sum(axis=2)
    dv = dv.reshape(b, hk, groups, tk_pad, d).sum(axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


__all__ = ["flash_backward_tpu", "flash_forward_tpu"]
