"""Pallas flash-attention kernels: forward (with log-sum-exp) and the dq / dk-dv backward.

All kernels work on padded, head-major arrays ``q [b, h, tq_pad, d_pad]`` and ``k, v [b, hk,
tk_pad, d_pad]`` (see :mod:`pallas_kernels.flash_attention.api` for the padding). They use only
the portable Pallas subset (``pallas_call`` + ``BlockSpec`` grid, ``fori_loop`` over key blocks
sliced from a full-sequence ref, 2-D iota masks, ``pl.dot``), so one body lowers to

* GPU: Triton (``platform="gpu"``; power-of-two blocks, no scratch), and
* TPU: Mosaic (``platform="tpu"``; blocks ``(block, d_pad)`` with ``block % 8 == 0`` and per-row
  statistics stored as ``[..., t, 1]`` so every block's trailing dims are legal),

and runs anywhere with ``interpret=True``. DERIVED: on TPU this variant keeps one head's whole K/V
in VMEM (``2 · tk · d`` elements), which fits up to roughly 16K tokens at d=128 in bf16; the
streaming ``(b, h, nq, nk)`` grid of the SALE block-sparse TPU kernel is the long-context path.

The forward follows FlashAttention-2 (online softmax, fp32 statistics); the backward recomputes
``P = exp(c·q kᵀ − lse)`` block by block (FlashAttention-2, Alg. 2) in two kernels, one over
query blocks (dq) and one over key blocks (dk, dv per query head; the wrapper sums GQA groups).

References:
  Dao, FlashAttention-2, https://arxiv.org/abs/2307.08691
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.reference import MASK_VALUE

PLATFORMS = ("gpu", "tpu", "interpret")


#: Scoped VMEM the TPU kernels may use. Mosaic's default (16 MiB) is a quarter of a v5e / v6e
#: TensorCore's 128 MiB; the kernels that keep one head's whole K/V (or Q) sequence resident
#: need more from about 8K tokens at head_dim 128 (a [t, 1] fp32 statistic occupies t × 128
#: lanes in VMEM). 64 MiB fits every generation (v5p: 95 MiB).
TPU_VMEM_LIMIT_BYTES = 64 * 1024 * 1024


def compiler_params(platform: str, n_grid: int):
    """Backend compiler parameters: Triton on GPU; Mosaic on TPU with all grid axes parallel
    and :data:`TPU_VMEM_LIMIT_BYTES` of scoped VMEM."""
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_grid,
                                    vmem_limit_bytes=TPU_VMEM_LIMIT_BYTES)
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return None


def block_dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul of two loaded blocks (``aᵀ`` / ``bᵀ`` by flag, no transpose op) with fp32
    accumulation (int32 for integer blocks); lowers on Triton and Mosaic alike. The attention
    kernels (flash, SALE, subspace) share it."""
    out = jnp.int32 if jnp.issubdtype(a.dtype, jnp.integer) else jnp.float32
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=out)


class Masks(NamedTuple):
    """Static mask / logit options of the flash kernels (the reference's keywords).

    ``causal``: query ``i`` sees keys ``j <= i``; ``kv_len``: keys ``>= kv_len`` are padding;
    ``window``: query ``i`` sees keys ``j > i - window`` only; ``softcap``: logits become
    ``cap · tanh(logits / cap)``; ``segments``: ``q_seg`` / ``kv_seg`` inputs are passed and a
    query sees only keys of its segment.
    """

    causal: bool
    kv_len: int
    window: int | None = None
    softcap: float | None = None
    segments: bool = False


def pair_mask(row0, col0, shape, masks: Masks, q_seg=None, kv_seg=None):
    """Boolean ``shape`` mask of the pairs a query block may attend to in a key block."""
    col = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = col < masks.kv_len
    if masks.causal or masks.window is not None:
        row = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        if masks.causal:
            mask = jnp.logical_and(mask, col <= row)
        if masks.window is not None:
            mask = jnp.logical_and(mask, col > row - masks.window)
    if masks.segments:
        mask = jnp.logical_and(mask, q_seg == kv_seg)  # [bq, 1] == [1, bk]
    return mask


def block_logits(q, kb, scale, masks: Masks):
    """``(s, t)``: the (soft-capped) logits of a block and ``tanh(s_raw / cap)`` (or None)."""
    s = block_dot(q, kb, trans_b=True) * scale
    if masks.softcap is None:
        return s, None
    t = jnp.tanh(s / masks.softcap)
    return masks.softcap * t, t


def kv_block_range(qi, block_q, block_k, masks: Masks):
    """``[lower, upper)`` key blocks a query block needs (causal: up to the diagonal; window:
    from the window's start)."""
    n_kv_blocks = -(-masks.kv_len // block_k)
    upper = n_kv_blocks
    if masks.causal:
        upper = jnp.minimum(lax.div((qi + 1) * block_q + block_k - 1, block_k), n_kv_blocks)
    lower = 0
    if masks.window is not None:
        lower = lax.div(jnp.maximum(qi * block_q - masks.window + 1, 0), block_k)
    return lower, upper


def q_block_range(kj, block_q, block_k, n_q_blocks, masks: Masks):
    """``[lower, upper)`` query blocks that see a key block (the transpose of
    :func:`_kv_blocks`)."""
    lower = lax.div(kj * block_k, block_q) if masks.causal else 0
    upper = n_q_blocks
    if masks.window is not None:  # query r sees key c only if r < c + window
        last = kj * block_k + block_k - 1 + masks.window - 1
        upper = jnp.minimum(lax.div(last, block_q) + 1, n_q_blocks)
    return lower, upper


def split_refs(refs, n_in: int, masks: Masks):
    """``(inputs, q_seg_ref, kv_seg_ref, outputs)`` of a kernel's refs (segment refs optional)."""
    if masks.segments:
        return refs[:n_in], refs[n_in], refs[n_in + 1], refs[n_in + 2:]
    return refs[:n_in], None, None, refs[n_in:]


def _fwd_kernel(*refs, scale, block_q, block_k, masks: Masks):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref) = split_refs(refs, 3, masks)
    qi = pl.program_id(2)
    q = q_ref[...]
    q_seg = qs_ref[...] if masks.segments else None
    lower, upper = kv_block_range(qi, block_q, block_k, masks)
    d = q.shape[-1]

    def body(j, carry):
        acc, m, l = carry
        start = pl.multiple_of(j * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :]
        vb = v_ref[pl.ds(start, block_k), :]
        s, _ = block_logits(q, kb, scale, masks)
        mask = pair_mask(qi * block_q, start, (block_q, block_k), masks, q_seg,
                      ks_ref[j] if masks.segments else None)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + block_dot(p.astype(vb.dtype), vb)
        return acc, m_new, l_new

    acc0 = jnp.zeros((block_q, d), jnp.float32)
    m0 = jnp.full((block_q, 1), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_q, 1), jnp.float32)
    acc, m, l = lax.fori_loop(lower, upper, body, (acc0, m0, l0))
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l_safe)


def dlogits(p, dp, delta, t):
    """``dL/ds_raw`` of a block: the softmax backward, through the soft-cap when set."""
    ds = p * (dp - delta)
    return ds if t is None else ds * (1.0 - t * t)


def _dq_kernel(*refs, scale, block_q, block_k, masks: Masks):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dq_ref,) = split_refs(
        refs, 6, masks)
    qi = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = qs_ref[...] if masks.segments else None
    lower, upper = kv_block_range(qi, block_q, block_k, masks)

    def body(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :]
        vb = v_ref[pl.ds(start, block_k), :]
        s, t = block_logits(q, kb, scale, masks)
        mask = pair_mask(qi * block_q, start, (block_q, block_k), masks, q_seg,
                      ks_ref[j] if masks.segments else None)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dp = block_dot(do, vb, trans_b=True)
        ds = dlogits(p, dp, delta, t)
        return dq + block_dot(ds.astype(kb.dtype), kb)

    dq = lax.fori_loop(lower, upper, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, block_q, block_k, masks: Masks):
    inputs, qs_ref, ks_ref, (dk_ref, dv_ref) = split_refs(refs, 6, masks)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    kj = pl.program_id(2)
    kb, vb = k_ref[...], v_ref[...]
    kv_seg = ks_ref[...] if masks.segments else None
    n_q_blocks = q_ref.shape[0] // block_q
    lower, upper = q_block_range(kj, block_q, block_k, n_q_blocks, masks)

    def body(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * block_q, block_q)
        qb = q_ref[pl.ds(start, block_q), :]
        dob = do_ref[pl.ds(start, block_q), :]
        lse = lse_ref[pl.ds(start, block_q), :]
        delta = delta_ref[pl.ds(start, block_q), :]
        s, t = block_logits(qb, kb, scale, masks)
        mask = pair_mask(start, kj * block_k, (block_q, block_k), masks,
                      qs_ref[pl.ds(start, block_q), :] if masks.segments else None, kv_seg)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dv = dv + block_dot(p.astype(dob.dtype), dob, trans_a=True)
        dp = block_dot(dob, vb, trans_b=True)
        ds = dlogits(p, dp, delta, t)
        dk = dk + block_dot(ds.astype(qb.dtype), qb, trans_a=True)
        return dk, dv

    zeros = jnp.zeros(kb.shape, jnp.float32)
    dk, dv = lax.fori_loop(lower, upper, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _row_spec(block: int, d: int, head_map):
    return pl.BlockSpec((None, None, block, d), head_map)


def segment_layouts(q_seg, kv_seg, block_k: int):
    """Kernel layouts of padded segment ids: ``q_seg [b, tq_pad] -> [b, tq_pad, 1]`` (a column
    per query block) and ``kv_seg [b, tk_pad] -> [b, nK, 1, block_k]`` (one row per key block,
    indexed on a leading axis: legal TPU blocks, no unaligned lane offsets)."""
    b, tk_pad = kv_seg.shape
    return (q_seg.astype(jnp.int32)[:, :, None],
            kv_seg.astype(jnp.int32).reshape(b, tk_pad // block_k, 1, block_k))


def _segment_specs(masks: Masks, tq_pad, tk_pad, block_q, block_k, q_blocked: bool):
    """BlockSpecs of the two segment inputs: per-block (fwd / dq: query rows; dkv: key row)
    and whole-sequence (the side the kernel loops over)."""
    if not masks.segments:
        return []
    n_k = tk_pad // block_k
    if q_blocked:  # grid over query blocks
        return [pl.BlockSpec((None, block_q, 1), lambda bi, hi, i: (bi, i, 0)),
                pl.BlockSpec((None, n_k, 1, block_k), lambda bi, hi, i: (bi, 0, 0, 0))]
    return [pl.BlockSpec((None, tq_pad, 1), lambda bi, hi, j: (bi, 0, 0)),
            pl.BlockSpec((None, None, 1, block_k), lambda bi, hi, j: (bi, j, 0, 0))]


_STATIC = ("scale", "block_q", "block_k", "masks", "platform", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_forward(q, k, v, segments=(), *, scale, block_q, block_k, masks: Masks,
                  platform="interpret", interpret=True):
    """Forward kernel on padded ``[b, h, t, d]`` arrays: output and lse ``[b, h, tq_pad, 1]``.

    ``segments``: ``()`` or :func:`segment_layouts` of the padded segment ids
    (``masks.segments`` says which).
    """
    b, h, tq_pad, d = q.shape
    hk, tk_pad = k.shape[1], k.shape[2]
    groups = h // hk
    kernel = functools.partial(_fwd_kernel, scale=scale, block_q=block_q, block_k=block_k,
                               masks=masks)
    q_spec = _row_spec(block_q, d, lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_spec = _row_spec(tk_pad, d, lambda bi, hi, qi: (bi, hi // groups, 0, 0))
    lse_spec = _row_spec(block_q, 1, lambda bi, hi, qi: (bi, hi, qi, 0))
    seg_specs = _segment_specs(masks, tq_pad, tk_pad, block_q, block_k, q_blocked=True)
    return pl.pallas_call(
        kernel,
        grid=(b, h, tq_pad // block_q),
        in_specs=[q_spec, kv_spec, kv_spec] + seg_specs,
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, tq_pad, 1), jnp.float32)],
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="flash_attention_fwd",
    )(q, k, v, *segments)


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_backward(q, k, v, out, lse, d_out, segments=(), *, scale, block_q, block_k,
                   masks: Masks, platform="interpret", interpret=True):
    """Backward kernels: ``(dq, dk, dv)`` in the padded layout (dk, dv summed over GQA groups)."""
    b, h, tq_pad, d = q.shape
    hk, tk_pad = k.shape[1], k.shape[2]
    groups = h // hk
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    d_out = d_out.astype(q.dtype)
    statics = dict(scale=scale, block_q=block_q, block_k=block_k, masks=masks)

    q_spec = _row_spec(block_q, d, lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_full = _row_spec(tk_pad, d, lambda bi, hi, qi: (bi, hi // groups, 0, 0))
    stat_spec = _row_spec(block_q, 1, lambda bi, hi, qi: (bi, hi, qi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid=(b, h, tq_pad // block_q),
        in_specs=[q_spec, kv_full, kv_full, q_spec, stat_spec, stat_spec] + _segment_specs(
            masks, tq_pad, tk_pad, block_q, block_k, q_blocked=True),
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="flash_attention_dq",
    )(q, k, v, d_out, lse, delta, *segments)

    q_full = _row_spec(tq_pad, d, lambda bi, hi, kj: (bi, hi, 0, 0))
    stat_full = _row_spec(tq_pad, 1, lambda bi, hi, kj: (bi, hi, 0, 0))
    kv_spec = _row_spec(block_k, d, lambda bi, hi, kj: (bi, hi // groups, kj, 0))
    dkv_out = _row_spec(block_k, d, lambda bi, hi, kj: (bi, hi, kj, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **statics),
        grid=(b, h, tk_pad // block_k),
        in_specs=[q_full, kv_spec, kv_spec, q_full, stat_full, stat_full] + _segment_specs(
            masks, tq_pad, tk_pad, block_q, block_k, q_blocked=False),
        out_specs=[dkv_out, dkv_out],
        out_shape=[jax.ShapeDtypeStruct((b, h, tk_pad, d), jnp.float32)] * 2,
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="flash_attention_dkv",
    )(q, k, v, d_out, lse, delta, *segments)
    dk = dk.reshape(b, hk, groups, tk_pad, d).sum(axis=2)
    dv = dv.reshape(b, hk, groups, tk_pad, d).sum(axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def export_lowering(fn, *args, platform: str = "tpu", device_kind: str | None = None):
    """Run the full Pallas lowering of ``jax.jit(fn)(*args)`` for another platform, on any host.

    ``platform="tpu"`` lowers through Mosaic TPU; ``"cuda"`` through Triton. An abstract mesh
    names the target device so hardware-dependent lowering rules work without the device
    (see pallas_notes.md §5). Returns the ``jax.export.Exported``; raises the lowering error.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> s = jax.ShapeDtypeStruct((1, 1, 128, 128), jnp.bfloat16)
        >>> f = lambda q, k, v: flash_forward(q, k, v, scale=0.1, block_q=128, block_k=128,
        ...     masks=Masks(causal=True, kv_len=128), platform="tpu", interpret=False)
        >>> export_lowering(f, s, s, s, platform="tpu").platforms
        ('tpu',)
    """
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    if platform == "tpu":
        kind, disabled = device_kind or "TPU v5 lite", ()
    elif platform == "cuda":
        kind = device_kind or "NVIDIA H200"
        disabled = (export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),)
    else:
        raise ValueError(f"platform={platform!r}; export_lowering supports 'tpu' and 'cuda'.")
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=1 if platform == "tpu" else None, platform=platform))
    with use_abstract_mesh(mesh):
        return export.export(jax.jit(fn), platforms=[platform],
                             disabled_checks=list(disabled))(*args)
__all__ = ["Masks", "PLATFORMS", "TPU_VMEM_LIMIT_BYTES", "block_dot", "compiler_params",
           "export_lowering", "flash_backward", "flash_forward", "segment_layouts"]
