"""SALE Pallas kernels: the block-selection pass and the block-sparse attention pass.

All arrays are head-major and padded (see :mod:`pallas_kernels.sparse_attention.api`):
``N_pad`` is a multiple of ``block_q`` and ``block_k``, the head dim a power of two ≥ 16.

* :func:`sale_select` — grid ``(B, Hq, nQ)``; each program loads its query block of 4-bit codes
  and loops (``fori_loop``) over the *middle* key blocks ``1 .. middle_end(d(i))``, computing
  ``ŝ = (Q̂ K̂ᵀ) s^q s^k + qmk`` exactly (integer codes as bf16, fp32 accumulation: exact since
  ``|Σ| ≤ 49·D < 2^24``) and testing ``ŝ > T_i``. It writes one int32 row ``[1, nK_pad]``
  per query block (layout ``[B, Hq, nQ, 1, nK_pad]``: trailing block dims equal the array's,
  legal on TPU; ``nK_pad`` a power of two for Triton). Portable subset: Triton and Mosaic TPU.
* :func:`block_sparse_attention` (GPU / interpret) — grid ``(B, Hq, nQ)``, ``fori_loop`` over
  the ``count`` selected key blocks read from a lookup table, online softmax in fp32.
* :func:`block_sparse_attention_tpu` — the splash-attention design: scalar-prefetched LUT and
  counts (in SMEM-sized chunks of query-block rows), grid ``(rows, max_count)`` with the last
  axis "arbitrary", the K/V index map
  reading ``lut[min(t, count−1)]`` (repeating the last id skips the DMA), VMEM accumulators;
  streams K/V block by block, so it has no sequence-length limit from VMEM.

References:
  Ji et al., SALE, https://arxiv.org/abs/2505.24179;
  Dao, FlashAttention-2, https://arxiv.org/abs/2307.08691
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.kernel import block_dot, compiler_params
from pallas_kernels.sparse_attention.reference import MASK_VALUE

_LANES = 128  # TPU lane width: per-row statistics are kept lane-replicated in VMEM


def _middle_end(d, *, local_blocks: int, blocks_per_segment: int):
    offset = blocks_per_segment * (-(-local_blocks // blocks_per_segment))
    n_loc = local_blocks + lax.rem(d - local_blocks + offset, blocks_per_segment)
    return jnp.maximum(d - n_loc, 0)


def _select_kernel(qc_ref, qs_ref, thr_ref, kc_ref, ks_ref, qmk_ref, out_ref, *, block_q, block_k,
                   n, local_blocks, blocks_per_segment):
    qi = pl.program_id(2)
    n_k = -(-n // block_k)
    n_k_pad = out_ref.shape[-1]
    qb = qc_ref[...].astype(jnp.bfloat16)
    qs, thr = qs_ref[...], thr_ref[...]
    d = jnp.minimum(lax.div((qi + 1) * block_q - 1, block_k), n_k - 1)
    mid = _middle_end(d, local_blocks=local_blocks, blocks_per_segment=blocks_per_segment)
    row = qi * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    lane = lax.broadcasted_iota(jnp.int32, (1, n_k_pad), 1)

    def body(j, sel):
        start = pl.multiple_of(j * block_k, block_k)
        kb = kc_ref[pl.ds(start, block_k), :].astype(jnp.bfloat16)
        prod = block_dot(qb, kb, trans_b=True)
        # per-key rows [nK, block_k]: row j is block j (a dynamic sublane index, which Mosaic
        # aligns; a lane offset j·block_k into a [1, N] row it cannot prove 128-aligned)
        est = prod * qs * ks_ref[pl.ds(j, 1), :] + qmk_ref[pl.ds(j, 1), :]
        col = start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        hit = jnp.where((est > thr) & (col <= row), 1, 0)
        any_hit = jnp.max(jnp.max(hit, axis=1, keepdims=True), axis=0, keepdims=True)  # (1, 1)
        return jnp.where(lane == j, any_hit, sel)

    sel = lax.fori_loop(1, mid + 1, body, jnp.zeros((1, n_k_pad), jnp.int32))
    out_ref[...] = sel


@functools.partial(
    jax.jit,
    static_argnames=("block_q", "block_k", "n", "local_blocks", "blocks_per_segment", "platform",
                     "interpret"),
)
def sale_select(q_codes, q_scale, thresholds, k_codes, k_scale, qmk, *, block_q, block_k, n,
                local_blocks, blocks_per_segment, platform="interpret", interpret=True):
    """Middle-block hits ``[B, Hq, nQ, nK]`` (bool) from padded SALE inputs.

    Args:
      q_codes: int8 ``[B, Hq, N_pad, D_pad]``; q_scale, thresholds: fp32 ``[B, Hq, N_pad, 1]``.
      k_codes: int8 ``[B, Hkv, N_pad, D_pad]``; k_scale: fp32 ``[B, Hkv, 1, N_pad]``.
      qmk: fp32 ``[B, Hq, 1, N_pad]``. Both are read block by block as ``[nK, block_k]``.
      n: the real sequence length (keys ≥ n never hit because middle blocks end before d(i)).
    """
    b, hq, n_pad, dim = q_codes.shape
    groups = hq // k_codes.shape[1]
    n_q, n_k = n_pad // block_q, n_pad // block_k
    n_k_pad = 1 << max(n_k - 1, 0).bit_length()
    kernel = functools.partial(_select_kernel, block_q=block_q, block_k=block_k, n=n,
                               local_blocks=local_blocks, blocks_per_segment=blocks_per_segment)
    row_map = lambda bi, hi, qi: (bi, hi, qi, 0)  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(b, hq, n_q),
        in_specs=[
            pl.BlockSpec((None, None, block_q, dim), row_map),
            pl.BlockSpec((None, None, block_q, 1), row_map),
            pl.BlockSpec((None, None, block_q, 1), row_map),
            pl.BlockSpec((None, None, n_pad, dim), lambda bi, hi, qi: (bi, hi // groups, 0, 0)),
            pl.BlockSpec((None, None, n_k, block_k),
                         lambda bi, hi, qi: (bi, hi // groups, 0, 0)),
            pl.BlockSpec((None, None, n_k, block_k), lambda bi, hi, qi: (bi, hi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, 1, n_k_pad),
                               lambda bi, hi, qi: (bi, hi, qi, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hq, n_q, 1, n_k_pad), jnp.int32),
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="sale_select",
    )(q_codes, q_scale, thresholds, k_codes, k_scale.reshape(b, -1, n_k, block_k),
      qmk.reshape(b, hq, n_k, block_k))
    return out[:, :, :, 0, :n_k] > 0


def _online_softmax_step(q, kb, vb, mask, acc, m, l, scale):
    s = jnp.where(mask, block_dot(q, kb, trans_b=True) * scale, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    return alpha * acc + block_dot(p.astype(vb.dtype), vb), m_new, l_new


def _block_mask(row0, col0, shape, n):
    row = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    col = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (col <= row) & (col < n)


def _sparse_kernel(lut_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, *, block_q, block_k, n, scale):
    qi = pl.program_id(2)
    q = q_ref[...]
    count = cnt_ref[0, 0]

    def body(t, carry):
        start = pl.multiple_of(lut_ref[0, t] * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :]
        vb = v_ref[pl.ds(start, block_k), :]
        mask = _block_mask(qi * block_q, start, (block_q, block_k), n)
        return _online_softmax_step(q, kb, vb, mask, *carry, scale)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((block_q, 1), jnp.float32))
    acc, _, l = lax.fori_loop(0, count, body, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("block_q", "block_k", "n", "scale", "platform", "interpret"))
def block_sparse_attention(q, k, v, lut, counts, *, block_q, block_k, n, scale,
                           platform="interpret", interpret=True):
    """Causal attention over the LUT-listed key blocks (GPU Triton / interpret variant).

    Args:
      q: ``[B, Hq, N_pad, D_pad]``; k, v: ``[B, Hkv, N_pad, D_pad]``.
      lut: int32 ``[B, Hq, nQ, max_count]`` selected key-block ids (any order, first ``count``).
      counts: int32 ``[B, Hq, nQ]``.
      n: real length (keys ≥ n are masked).
    """
    b, hq, n_pad, dim = q.shape
    groups = hq // k.shape[1]
    max_count = lut.shape[-1]
    max_pad = 1 << max(max_count - 1, 0).bit_length()
    lut = jnp.pad(lut, ((0, 0), (0, 0), (0, 0), (0, max_pad - max_count)))[:, :, :, None, :]
    counts = counts[:, :, :, None, None].astype(jnp.int32)
    kernel = functools.partial(_sparse_kernel, block_q=block_q, block_k=block_k, n=n, scale=scale)
    q_spec = pl.BlockSpec((None, None, block_q, dim), lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec((None, None, n_pad, dim), lambda bi, hi, qi: (bi, hi // groups, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, hq, n_pad // block_q),
        in_specs=[
            pl.BlockSpec((None, None, None, 1, max_pad), lambda bi, hi, qi: (bi, hi, qi, 0, 0)),
            pl.BlockSpec((None, None, None, 1, 1), lambda bi, hi, qi: (bi, hi, qi, 0, 0)),
            q_spec, kv_spec, kv_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="sale_block_sparse_attention",
    )(lut.astype(jnp.int32), counts, q, k, v)


#: Lookup-table words one TPU kernel call prefetches into SMEM (1 MiB on v5e, shared with the
#: counts and Mosaic's own scalars): the rows of a longer table run in chunks (a ``lax.scan``).
SMEM_LUT_WORDS = 64 * 1024


def _sparse_tpu_kernel(off_ref, lut_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc,
                       *, block_q, block_k, n, scale, n_q, max_count):
    r, t = pl.program_id(0), pl.program_id(1)
    qi = lax.rem(off_ref[0] + r, n_q)
    count = cnt_ref[r]

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(t < count)
    def _step():
        start = lut_ref[r * max_count + t] * block_k
        mask = _block_mask(qi * block_q, start, (block_q, block_k), n)
        m_prev, l_prev = m_sc[...][:, :1], l_sc[...][:, :1]
        acc, m_new, l_new = _online_softmax_step(q_ref[...], k_ref[...], v_ref[...], mask,
                                                 acc_sc[...], m_prev, l_prev, scale)
        acc_sc[...] = acc
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(t == max_count - 1)
    def _write():
        l = l_sc[...][:, :1]
        o_ref[...] = (acc_sc[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("block_q", "block_k", "n", "scale", "platform", "interpret",
                              "lut_words"))
def block_sparse_attention_tpu(q, k, v, lut, counts, *, block_q, block_k, n, scale,
                               platform="tpu", interpret=False, lut_words=SMEM_LUT_WORDS):
    """Same contract as :func:`block_sparse_attention`, as a Mosaic-TPU splash-style kernel.

    The query blocks of all (batch, head) pairs form ``rows = B·Hq·nQ`` rows; a kernel call
    covers a chunk of rows whose lookup table (``chunk · max_count`` int32) fits ``lut_words``
    of SMEM, and a ``lax.scan`` runs the chunks (one call when the whole table fits), so the
    table's quadratic growth with the sequence never exceeds the TPU's SMEM.
    """
    from jax.experimental.pallas import tpu as pltpu

    b, hq, n_pad, dim = q.shape
    groups = hq // k.shape[1]
    n_q, max_count = n_pad // block_q, lut.shape[-1]
    rows = b * hq * n_q
    chunk = max(1, min(rows, lut_words // max_count))
    n_chunks = -(-rows // chunk)
    pad = n_chunks * chunk - rows
    luts = jnp.pad(lut.reshape(rows, max_count).astype(jnp.int32), ((0, pad), (0, 0)))
    cnts = jnp.pad(counts.reshape(rows).astype(jnp.int32), (0, pad))
    luts = luts.reshape(n_chunks, chunk * max_count)
    cnts = cnts.reshape(n_chunks, chunk)
    offsets = (jnp.arange(n_chunks, dtype=jnp.int32) * chunk)[:, None]
    q_rows = jnp.pad(q.reshape(rows, block_q, dim), ((0, pad), (0, 0), (0, 0)))

    def kv_map(r, t, off_ref, lut_ref, cnt_ref):
        row = jnp.minimum(off_ref[0] + r, rows - 1)
        bi, hi = lax.div(row, hq * n_q), lax.rem(lax.div(row, n_q), hq)
        last = jnp.maximum(jnp.minimum(t, cnt_ref[r] - 1), 0)
        return bi, hi // groups, lut_ref[r * max_count + last], 0

    q_spec = pl.BlockSpec((None, block_q, dim), lambda r, t, off, *_: (off[0] + r, 0, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, dim), kv_map)
    kernel = functools.partial(_sparse_tpu_kernel, block_q=block_q, block_k=block_k, n=n,
                               scale=scale, n_q=n_q, max_count=max_count)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(chunk, max_count),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=pl.BlockSpec((None, block_q, dim), lambda r, t, *_: (r, 0, 0)),
        scratch_shapes=[pltpu.VMEM((block_q, _LANES), jnp.float32),
                        pltpu.VMEM((block_q, _LANES), jnp.float32),
                        pltpu.VMEM((block_q, dim), jnp.float32)],
    )
    params = None
    if platform == "tpu":
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    call = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((chunk, block_q, dim), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="sale_block_sparse_attention_tpu",
    )
    if n_chunks == 1:
        out = call(offsets[0], luts[0], cnts[0], q_rows, k, v)[None]
    else:
        _, out = lax.scan(lambda _, xs: (None, call(*xs, q_rows, k, v)), None,
                          (offsets, luts, cnts))
    return out.reshape(n_chunks * chunk, block_q, dim)[:rows].reshape(q.shape)


__all__ = ["block_sparse_attention", "block_sparse_attention_tpu", "sale_select"]
