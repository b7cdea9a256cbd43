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


def _masks(row0, col0, shape, *, causal: bool, kv_len: int):
    """Boolean ``shape`` mask: key inside the real sequence (and not after the query if causal)."""
    col = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
    mask = col < kv_len
    if causal:
        row = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        mask = jnp.logical_and(mask, col <= row)
    return mask


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal, block_q, block_k, kv_len):
    qi = pl.program_id(2)
    q = q_ref[...]
    n_kv_blocks = -(-kv_len // block_k)
    if causal:
        upper = jnp.minimum(lax.div((qi + 1) * block_q + block_k - 1, block_k), n_kv_blocks)
    else:
        upper = n_kv_blocks
    d = q.shape[-1]

    def body(j, carry):
        acc, m, l = carry
        start = pl.multiple_of(j * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :]
        vb = v_ref[pl.ds(start, block_k), :]
        s = block_dot(q, kb, trans_b=True) * scale
        mask = _masks(qi * block_q, start, (block_q, block_k), causal=causal, kv_len=kv_len)
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
    acc, m, l = lax.fori_loop(0, upper, body, (acc0, m0, l0))
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l_safe)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, causal,
               block_q, block_k, kv_len):
    qi = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    n_kv_blocks = -(-kv_len // block_k)
    if causal:
        upper = jnp.minimum(lax.div((qi + 1) * block_q + block_k - 1, block_k), n_kv_blocks)
    else:
        upper = n_kv_blocks

    def body(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        kb = k_ref[pl.ds(start, block_k), :]
        vb = v_ref[pl.ds(start, block_k), :]
        s = block_dot(q, kb, trans_b=True) * scale
        mask = _masks(qi * block_q, start, (block_q, block_k), causal=causal, kv_len=kv_len)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dp = block_dot(do, vb, trans_b=True)
        ds = p * (dp - delta)
        return dq + block_dot(ds.astype(kb.dtype), kb)

    dq = lax.fori_loop(0, upper, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale,
                causal, block_q, block_k, kv_len):
    kj = pl.program_id(2)
    kb, vb = k_ref[...], v_ref[...]
    n_q_blocks = q_ref.shape[0] // block_q
    lower = lax.div(kj * block_k, block_q) if causal else 0

    def body(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * block_q, block_q)
        qb = q_ref[pl.ds(start, block_q), :]
        dob = do_ref[pl.ds(start, block_q), :]
        lse = lse_ref[pl.ds(start, block_q), :]
        delta = delta_ref[pl.ds(start, block_q), :]
        s = block_dot(qb, kb, trans_b=True) * scale
        mask = _masks(start, kj * block_k, (block_q, block_k), causal=causal, kv_len=kv_len)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dv = dv + block_dot(p.astype(dob.dtype), dob, trans_a=True)
        dp = block_dot(dob, vb, trans_b=True)
        ds = p * (dp - delta)
        dk = dk + block_dot(ds.astype(qb.dtype), qb, trans_a=True)
        return dk, dv

    zeros = jnp.zeros(kb.shape, jnp.float32)
    dk, dv = lax.fori_loop(lower, n_q_blocks, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _row_spec(block: int, d: int, head_map):
    return pl.BlockSpec((None, None, block, d), head_map)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "block_q", "block_k", "kv_len", "platform", "interpret"),
)
def flash_forward(q, k, v, *, causal, scale, block_q, block_k, kv_len, platform="interpret",
                  interpret=True):
    """Forward kernel on padded ``[b, h, t, d]`` arrays: output and lse ``[b, h, tq_pad, 1]``."""
    b, h, tq_pad, d = q.shape
    hk, tk_pad = k.shape[1], k.shape[2]
    groups = h // hk
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, block_q=block_q,
                               block_k=block_k, kv_len=kv_len)
    q_spec = _row_spec(block_q, d, lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_spec = _row_spec(tk_pad, d, lambda bi, hi, qi: (bi, hi // groups, 0, 0))
    lse_spec = _row_spec(block_q, 1, lambda bi, hi, qi: (bi, hi, qi, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, h, tq_pad // block_q),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, tq_pad, 1), jnp.float32)],
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="flash_attention_fwd",
    )(q, k, v)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "block_q", "block_k", "kv_len", "platform", "interpret"),
)
def flash_backward(q, k, v, out, lse, d_out, *, causal, scale, block_q, block_k, kv_len,
                   platform="interpret", interpret=True):
    """Backward kernels: ``(dq, dk, dv)`` in the padded layout (dk, dv summed over GQA groups)."""
    b, h, tq_pad, d = q.shape
    hk, tk_pad = k.shape[1], k.shape[2]
    groups = h // hk
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    d_out = d_out.astype(q.dtype)
    statics = dict(scale=scale, causal=causal, block_q=block_q, block_k=block_k, kv_len=kv_len)

    q_spec = _row_spec(block_q, d, lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_full = _row_spec(tk_pad, d, lambda bi, hi, qi: (bi, hi // groups, 0, 0))
    stat_spec = _row_spec(block_q, 1, lambda bi, hi, qi: (bi, hi, qi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid=(b, h, tq_pad // block_q),
        in_specs=[q_spec, kv_full, kv_full, q_spec, stat_spec, stat_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="flash_attention_dq",
    )(q, k, v, d_out, lse, delta)

    q_full = _row_spec(tq_pad, d, lambda bi, hi, kj: (bi, hi, 0, 0))
    stat_full = _row_spec(tq_pad, 1, lambda bi, hi, kj: (bi, hi, 0, 0))
    kv_spec = _row_spec(block_k, d, lambda bi, hi, kj: (bi, hi // groups, kj, 0))
    dkv_out = _row_spec(block_k, d, lambda bi, hi, kj: (bi, hi, kj, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **statics),
        grid=(b, h, tk_pad // block_k),
        in_specs=[q_full, kv_spec, kv_spec, q_full, stat_full, stat_full],
        out_specs=[dkv_out, dkv_out],
        out_shape=[jax.ShapeDtypeStruct((b, h, tk_pad, d), jnp.float32)] * 2,
        compiler_params=compiler_params(platform, 3),
        interpret=interpret,
        name="flash_attention_dkv",
    )(q, k, v, d_out, lse, delta)
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
        >>> f = lambda q, k, v: flash_forward(q, k, v, causal=True, scale=0.1, block_q=128,
        ...     block_k=128, kv_len=128, platform="tpu", interpret=False)
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
__all__ = ["PLATFORMS", "block_dot", "compiler_params", "export_lowering", "flash_backward",
           "flash_forward"]
