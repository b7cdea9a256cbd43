"""Pallas kernels: rank-aware grouped LoRA shrink / expand over tokens sorted by adapter.

Portable subset only (``pallas_call`` grid, ``BlockSpec``, ``fori_loop``, ``pl.when``, ref slicing),
so the body lowers with Triton on GPU and runs in interpret mode on CPU.

* shrink: grid ``(N / block_m,)``; program ``i`` owns rows ``[i·bm, (i+1)·bm)`` and the whole
  ``[bm, R]`` output; the ``d_in`` contraction runs in chunks of ``block_k``. It loops over
  the K groups; a group that does not overlap the row tile is
  skipped (``pl.when``), and inside a group every rank chunk of ``block_r`` columns that starts at
  or beyond ``r_k`` is skipped, so padding ranks to ``R`` costs almost nothing.
* expand: grid ``(N / block_m, d_out / block_n)``; the contraction over ``R`` runs in chunks of
  ``block_r`` that are skipped past ``r_k``; ``acc`` (the base layer output) is added in place.

A tile that straddles two groups is visited once per group with the out-of-group rows zeroed
(DERIVED from megablox's ``make_group_metadata``, simplified to a loop over groups: fine for the
small K (≤ 16) of a packed hyperparameter sweep).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _shrink_kernel(off_ref, rank_ref, scale_ref, x_ref, a_ref, out_ref, *, num_groups, block_r,
                   block_k):
    block_m, r_max = out_ref.shape
    num_k = x_ref.shape[1] // block_k
    row0 = pl.program_id(0) * block_m
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def group(k, carry):
        start, end, rk = off_ref[k], off_ref[k + 1], rank_ref[k]
        in_group = (rows >= start) & (rows < end)

        @pl.when((start < row0 + block_m) & (end > row0) & (rk > 0))
        def _():
            for c in range(r_max // block_r):
                @pl.when(c * block_r < rk)
                def _():
                    window = pl.ds(c * block_r, block_r)

                    def contract(kk, acc):
                        kwin = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
                        x = x_ref[:, kwin]
                        x = jnp.where(in_group, x, jnp.zeros_like(x))
                        return acc + jax.lax.dot(x, a_ref[k, kwin, window],
                                                 preferred_element_type=jnp.float32)

                    d = jax.lax.fori_loop(0, num_k, contract,
                                          jnp.zeros((block_m, block_r), jnp.float32))
                    cols = c * block_r + jax.lax.broadcasted_iota(jnp.int32, (1, block_r), 1)
                    d = jnp.where(cols < rk, d * scale_ref[k], jnp.zeros_like(d))
                    out_ref[:, window] = out_ref[:, window] + d

        return carry

    jax.lax.fori_loop(0, num_groups, group, 0)


def _expand_kernel(off_ref, rank_ref, h_ref, b_ref, *rest, num_groups, block_r, has_acc):
    if has_acc:
        acc_ref, out_ref = rest
    else:
        (out_ref,) = rest
    block_m = out_ref.shape[0]
    r_max = h_ref.shape[1]
    row0 = pl.program_id(0) * block_m
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    if has_acc:
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)
    else:
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def group(k, carry):
        start, end, rk = off_ref[k], off_ref[k + 1], rank_ref[k]

        @pl.when((start < row0 + block_m) & (end > row0) & (rk > 0))
        def _():
            for c in range(r_max // block_r):
                @pl.when(c * block_r < rk)
                def _():
                    window = pl.ds(c * block_r, block_r)
                    h = h_ref[:, window]
                    cols = c * block_r + jax.lax.broadcasted_iota(jnp.int32, (1, block_r), 1)
                    keep = (rows >= start) & (rows < end) & (cols < rk)
                    h = jnp.where(keep, h, jnp.zeros_like(h))
                    w = b_ref[k, window, :]
                    out_ref[...] = out_ref[...] + jax.lax.dot(
                        h.astype(w.dtype), w, preferred_element_type=jnp.float32)

        return carry

    jax.lax.fori_loop(0, num_groups, group, 0)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("block_m", "block_r", "block_k", "interpret"))
def grouped_shrink(offsets, ranks, scale, x, a, *, block_m, block_r, block_k, interpret=False):
    """Kernel call; ``x [N, d_in]`` with ``N % block_m == 0``, ``R % block_r == 0``,
    ``d_in % block_k == 0``.

    ``offsets [P] int32`` are group boundaries (``offsets[k]..offsets[k+1]``), ``ranks [P]``,
    ``scale [P]`` (``P ≥ K + 1``, padded by the wrapper). Returns ``[N, R]`` fp32.
    """
    n, d_in = x.shape
    k, _, r_max = a.shape
    kernel = functools.partial(_shrink_kernel, num_groups=k, block_r=block_r, block_k=block_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, r_max), jnp.float32),
        grid=(n // block_m,),
        in_specs=[_full(offsets.shape), _full(ranks.shape), _full(scale.shape),
                  pl.BlockSpec((block_m, d_in), lambda i: (i, 0)), _full(a.shape)],
        out_specs=pl.BlockSpec((block_m, r_max), lambda i: (i, 0)),
        interpret=interpret,
        name="grouped_lora_shrink",
    )(offsets, ranks, scale, x, a)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_r", "interpret"))
def grouped_expand(offsets, ranks, h, b, acc=None, *, block_m, block_n, block_r,
                   interpret=False):
    """Kernel call; ``h [N, R]``, ``b [K, R, d_out]``, optional ``acc [N, d_out]``; fp32 out."""
    n, r_max = h.shape
    k, _, d_out = b.shape
    has_acc = acc is not None
    kernel = functools.partial(_expand_kernel, num_groups=k, block_r=block_r, has_acc=has_acc)
    in_specs = [_full(offsets.shape), _full(ranks.shape),
                pl.BlockSpec((block_m, r_max), lambda i, j: (i, 0)),
                pl.BlockSpec((k, r_max, block_n), lambda i, j: (0, 0, j))]
    args = [offsets, ranks, h, b]
    if has_acc:
        in_specs.append(pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)))
        args.append(acc)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, d_out), jnp.float32),
        grid=(n // block_m, d_out // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        interpret=interpret,
        name="grouped_lora_expand",
    )(*args)
