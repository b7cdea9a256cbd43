"""Pallas kernels of grouped LoRA: the grouped matmuls (gmm) and their per-group reductions (tgmm).

Rows (tokens) are sorted by group: group ``k`` owns rows ``offsets[k] .. offsets[k+1]``; its rank
``ranks[k]`` masks the padded rank slots. Three kernels cover the forward and the backward pass
(DERIVED from megablox's ``gmm`` / ``tgmm``, simplified to a loop over the few groups of a packed
sweep, K ≤ 16, instead of scalar-prefetched group metadata):

* :func:`grouped_nt` (shrink): ``out[t] = s_k (x_t · W_kᵀ) ⊙ m_k`` with ``W [K, R, D]`` — the
  down-projection (``W = Aᵀ``) and the input gradient of the up-projection (``W = B``).
* :func:`grouped_nn` (expand): ``out[t] = acc_t + s_k (h_t ⊙ m_k) · W_k`` with ``W [K, R, D]`` — the
  up-projection (``W = B``) and the input gradient of the down-projection (``W = Aᵀ``).
* :func:`grouped_tn` (tgmm): ``out[k] = (lhs_k ⊙ m_k)ᵀ · rhs_k`` ``[K, R, D]`` — the weight
  gradients (``dAᵀ`` from ``(dh, x)``, ``dB`` from ``(h, dy)``).

Every weight is held as ``[K, R, D]``: the long axis ``D`` is the lane axis (lane-dense on TPU,
contiguous loads on GPU), the rank ``R`` the sublane axis.

A row tile that straddles two groups is visited once per group with the out-of-group rows zeroed
(a tile overlaps at most K - 1 boundaries); a group whose rank chunk starts at or past ``r_k`` is
skipped (``pl.when``), so padding ranks to ``R`` costs almost nothing on a GPU.

Backends (``platform=``):

* ``"tpu"``: Mosaic. The group metadata (offsets, ranks, scales) lives in SMEM (scalars indexed by
  a loop variable; a VMEM vector load at an unaligned index is what Mosaic cannot prove aligned);
  blocks are full or (8, 128)-divisible, in-kernel lane offsets are 128-multiples; the weight
  gradient reduces over the row tiles as the last, ``"arbitrary"``, grid axis.
* ``"gpu"``: Triton, chosen explicitly (``pallas_kernels.grouped_lora.api`` says why); power-of-two
  tiles; the row reduction of the weight gradient is an in-kernel loop (Triton's grid programs run
  in parallel, so no output block may be revisited across programs).
* ``"interpret"``: the same bodies in Pallas interpret mode; the TPU grid is sequential there, so
  either reduction layout runs (``reduce_rows_in_grid``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.kernel import PLATFORMS  # noqa: E402 (one list)


def grouped_compiler_params(platform: str, semantics: tuple[str, ...]):
    """Mosaic params on TPU (``semantics`` per grid axis), Triton params on GPU, else None.

    Passing Triton params explicitly selects Triton: jax's default GPU lowering for a plain
    ``pallas_call`` is Mosaic GPU (``jax_pallas_use_mosaic_gpu``).
    """
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=semantics)
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return None


def _meta_spec(shape, platform: str):
    """The whole metadata vector, read as scalars: in SMEM on TPU."""
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul of two blocks of one dtype, fp32 accumulation (Mosaic and Triton alike)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _overlaps(start, end, row0, block_m, rank):
    return (start < row0 + block_m) & (end > row0) & (rank > 0)


def _nt_kernel(off_ref, rank_ref, scale_ref, x_ref, w_ref, out_ref, *, num_groups, block_r,
               block_k):
    block_m, r_max = out_ref.shape
    num_k = x_ref.shape[1] // block_k
    row0 = pl.program_id(0) * block_m
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def group(k, carry):
        start, end, rk = off_ref[k], off_ref[k + 1], rank_ref[k]

        @pl.when(_overlaps(start, end, row0, block_m, rk))
        def _():
            in_group = (rows >= start) & (rows < end)
            for c in range(r_max // block_r):
                @pl.when(c * block_r < rk)
                def _():
                    chunk = slice(c * block_r, (c + 1) * block_r)

                    def contract(kk, acc):
                        start = (kk * block_k if isinstance(kk, int)
                                 else pl.multiple_of(kk * block_k, block_k))
                        kwin = pl.ds(start, block_k)
                        w = w_ref[k, chunk, kwin]
                        return acc + _dot(x_ref[:, kwin].astype(w.dtype), w, trans_b=True)

                    zero = jnp.zeros((block_m, block_r), jnp.float32)
                    d = contract(0, zero) if num_k == 1 else jax.lax.fori_loop(
                        0, num_k, contract, zero)
                    cols = c * block_r + jax.lax.broadcasted_iota(jnp.int32, (1, block_r), 1)
                    d = jnp.where(in_group & (cols < rk), d * scale_ref[k], jnp.zeros_like(d))
                    out_ref[:, chunk] = out_ref[:, chunk] + d

        return carry

    jax.lax.fori_loop(0, num_groups, group, 0)


def _nn_kernel(off_ref, rank_ref, scale_ref, h_ref, w_ref, *rest, num_groups, block_r, has_acc):
    acc_ref, out_ref = rest if has_acc else (None, rest[0])
    block_m = out_ref.shape[0]
    r_max = h_ref.shape[1]
    row0 = pl.program_id(0) * block_m
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    if has_acc:
        total = acc_ref[...].astype(jnp.float32)
    else:
        total = jnp.zeros(out_ref.shape, jnp.float32)

    def group(k, total):
        start, end, rk = off_ref[k], off_ref[k + 1], rank_ref[k]
        in_group = (rows >= start) & (rows < end)

        def add(total):
            for c in range(r_max // block_r):
                def chunk(total, c=c):
                    window = slice(c * block_r, (c + 1) * block_r)
                    h = h_ref[:, window].astype(jnp.float32)
                    cols = c * block_r + jax.lax.broadcasted_iota(jnp.int32, (1, block_r), 1)
                    h = jnp.where(in_group & (cols < rk), h * scale_ref[k], jnp.zeros_like(h))
                    w = w_ref[k, window, :]
                    return total + _dot(h.astype(w.dtype), w)

                # chunk 0 is live whenever the group is (rank > 0)
                total = chunk(total) if c == 0 else jax.lax.cond(
                    c * block_r < rk, chunk, lambda t: t, total)
            return total

        return jax.lax.cond(_overlaps(start, end, row0, block_m, rk), add, lambda t: t, total)

    # fp32 running sum in registers / vregs, one store in the output dtype
    out_ref[...] = jax.lax.fori_loop(0, num_groups, group, total).astype(out_ref.dtype)


def _tn_tile(off_ref, rank_ref, lhs, rhs, out_ref, row0, num_groups):
    """``out[k] += (lhs ⊙ in_group_k ⊙ m_k)ᵀ rhs`` for the row tile starting at ``row0``."""
    block_m, r_max = lhs.shape
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, r_max), 1)

    def group(k, carry):
        start, end, rk = off_ref[k], off_ref[k + 1], rank_ref[k]

        @pl.when(_overlaps(start, end, row0, block_m, rk))
        def _():
            keep = (rows >= start) & (rows < end) & (cols < rk)
            part = jnp.where(keep, lhs, jnp.zeros_like(lhs)).astype(rhs.dtype)
            out_ref[k] = out_ref[k] + _dot(part, rhs, trans_a=True)

        return carry

    jax.lax.fori_loop(0, num_groups, group, 0)


def _zero_groups(out_ref):
    """Zero ``out_ref [K, R, bn]`` one group at a time (Triton: K need not be a power of two)."""
    def zero(k, carry):
        out_ref[k] = jnp.zeros(out_ref.shape[1:], out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, out_ref.shape[0], zero, 0)


def _tn_grid_kernel(off_ref, rank_ref, lhs_ref, rhs_ref, out_ref, *, num_groups):
    """Row tiles as the last (sequential) grid axis; the output block stays resident."""
    @pl.when(pl.program_id(1) == 0)
    def _():
        _zero_groups(out_ref)

    row0 = pl.program_id(1) * lhs_ref.shape[0]
    _tn_tile(off_ref, rank_ref, lhs_ref[...], rhs_ref[...], out_ref, row0, num_groups)


def _tn_loop_kernel(off_ref, rank_ref, lhs_ref, rhs_ref, out_ref, *, num_groups, block_m,
                    tiles_per_split):
    """One program per (row split, column tile): an in-kernel loop over the split's row tiles
    into the split's partial sum (the splits are summed by the caller)."""
    _zero_groups(out_ref)
    first = pl.program_id(0) * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, lhs_ref.shape[0] // block_m)

    def tile(i, carry):
        row0 = pl.multiple_of(i * block_m, block_m)
        rows = pl.ds(row0, block_m)
        _tn_tile(off_ref, rank_ref, lhs_ref[rows, :], rhs_ref[rows, :], out_ref, row0,
                 num_groups)
        return carry

    jax.lax.fori_loop(first, last, tile, 0)


@functools.partial(jax.jit, static_argnames=("block_m", "block_r", "block_k", "platform",
                                             "interpret"))
def grouped_nt(offsets, ranks, scale, x, w, *, block_m, block_r, block_k, platform="interpret",
               interpret=True):
    """``out [N, R] fp32``, ``out[t] = s_k (x_t W_kᵀ) ⊙ m_k`` (shrink) on padded operands.

    ``x [N, D]`` (``N % block_m == 0``, ``D % block_k == 0``), ``w [K, R, D]``
    (``R % block_r == 0``); ``offsets [P] int32`` group boundaries, ``ranks [P]``, ``scale [P]``
    (``P ≥ K + 1``, padded by the wrapper).
    """
    n, d_in = x.shape
    k, r_max, _ = w.shape
    kernel = functools.partial(_nt_kernel, num_groups=k, block_r=block_r, block_k=block_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, r_max), jnp.float32),
        grid=(n // block_m,),
        in_specs=[_meta_spec(offsets.shape, platform), _meta_spec(ranks.shape, platform),
                  _meta_spec(scale.shape, platform),
                  pl.BlockSpec((block_m, d_in), lambda i: (i, 0)),
                  pl.BlockSpec((k, r_max, d_in), lambda i: (0, 0, 0))],
        out_specs=pl.BlockSpec((block_m, r_max), lambda i: (i, 0)),
        compiler_params=grouped_compiler_params(platform, ("parallel",)),
        interpret=interpret,
        name="grouped_lora_shrink",
    )(offsets, ranks, scale, x, w)


@functools.partial(jax.jit, static_argnames=("block_m", "block_r", "block_n", "platform",
                                             "interpret", "out_dtype"))
def grouped_nn(offsets, ranks, scale, h, w, acc=None, *, block_m, block_r, block_n,
               platform="interpret", interpret=True, out_dtype=jnp.float32):
    """``out [N, D]``, ``out[t] = acc_t + s_k (h_t ⊙ m_k) W_k`` (expand) on padded operands.

    ``h [N, R]``, ``w [K, R, D]`` (``D % block_n == 0``), optional ``acc [N, D]``; the sum is
    fp32 and stored once as ``out_dtype`` (the input gradient is stored in the input's dtype).
    """
    n, r_max = h.shape
    k, _, d_out = w.shape
    has_acc = acc is not None
    kernel = functools.partial(_nn_kernel, num_groups=k, block_r=block_r, has_acc=has_acc)
    in_specs = [_meta_spec(offsets.shape, platform), _meta_spec(ranks.shape, platform),
                _meta_spec(scale.shape, platform),
                pl.BlockSpec((block_m, r_max), lambda i, j: (i, 0)),
                pl.BlockSpec((k, r_max, block_n), lambda i, j: (0, 0, j))]
    args = [offsets, ranks, scale, h, w]
    if has_acc:
        in_specs.append(pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)))
        args.append(acc)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, d_out), out_dtype),
        grid=(n // block_m, d_out // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=grouped_compiler_params(platform, ("parallel", "parallel")),
        interpret=interpret,
        name="grouped_lora_expand",
    )(*args)


@functools.partial(jax.jit, static_argnames=("num_groups", "block_m", "block_n", "platform",
                                             "interpret", "reduce_rows_in_grid", "row_splits"))
def grouped_tn(offsets, ranks, lhs, rhs, *, num_groups, block_m, block_n, platform="interpret",
               interpret=True, reduce_rows_in_grid=None, row_splits=None):
    """``out [K, R, D] fp32``, ``out[k] = (lhs_k ⊙ m_k)ᵀ rhs_k`` (tgmm) on padded operands.

    ``lhs [N, R]``, ``rhs [N, D]`` (``N % block_m == 0``, ``D % block_n == 0``). The reduction
    over rows runs as the last grid axis (``reduce_rows_in_grid``, the default on TPU) or as an
    in-kernel loop (the default elsewhere: Triton programs run in parallel). The loop form
    splits the rows into ``row_splits`` parallel partial sums (default: up to 8, so a GPU has
    ``8 × D / block_n`` programs, not only ``D / block_n``), added here.
    """
    n, r_max = lhs.shape
    d = rhs.shape[1]
    if reduce_rows_in_grid is None:
        reduce_rows_in_grid = platform == "tpu"
    if platform == "gpu" and reduce_rows_in_grid:
        raise ValueError("grouped_tn: reduce_rows_in_grid=True revisits an output block across "
                         "grid programs, which Triton runs in parallel; use False on GPU.")
    out_shape = jax.ShapeDtypeStruct((num_groups, r_max, d), jnp.float32)
    meta = [_meta_spec(offsets.shape, platform), _meta_spec(ranks.shape, platform)]
    if reduce_rows_in_grid:
        kernel = functools.partial(_tn_grid_kernel, num_groups=num_groups)
        grid = (d // block_n, n // block_m)
        in_specs = meta + [pl.BlockSpec((block_m, r_max), lambda j, i: (i, 0)),
                           pl.BlockSpec((block_m, block_n), lambda j, i: (i, j))]
        out_spec = pl.BlockSpec((num_groups, r_max, block_n), lambda j, i: (0, 0, j))
        semantics = ("parallel", "arbitrary")
    else:
        tiles = n // block_m
        splits = min(8, tiles) if row_splits is None else max(1, min(row_splits, tiles))
        per_split = -(-tiles // splits)
        splits = -(-tiles // per_split)  # no empty split
        kernel = functools.partial(_tn_loop_kernel, num_groups=num_groups, block_m=block_m,
                                   tiles_per_split=per_split)
        grid = (splits, d // block_n)
        in_specs = meta + [pl.BlockSpec((n, r_max), lambda s, j: (0, 0)),
                           pl.BlockSpec((n, block_n), lambda s, j: (0, j))]
        out_shape = jax.ShapeDtypeStruct((splits, num_groups, r_max, d), jnp.float32)
        out_spec = pl.BlockSpec((None, num_groups, r_max, block_n), lambda s, j: (s, 0, 0, j))
        semantics = ("parallel", "parallel")
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=grouped_compiler_params(platform, semantics),
        interpret=interpret,
        name="grouped_lora_tgmm",
    )(offsets, ranks, lhs, rhs)
    return out if reduce_rows_in_grid else out.sum(axis=0)


__all__ = ["PLATFORMS", "grouped_compiler_params", "grouped_nn", "grouped_nt", "grouped_tn"]
