"""Public grouped LoRA ops: ``lora_shrink`` / ``lora_expand`` by Pallas kernel or by XLA.

.. math::
    h_t = s_{k(t)}\\,(x_t A_{k(t)}) \\odot m_{k(t)},\\qquad
    y_t = \\mathrm{acc}_t + (h_t \\odot m_{k(t)}) B_{k(t)}

Rows are sorted by group (``group_sizes[k]`` consecutive rows for adapter ``k``); ``m_k`` masks
the padded rank slots ``r_k ≤ j < R``. Both ops are differentiable and PLoRA trains through them:
the forward and the backward pass are Pallas kernels (:mod:`.kernel`, a ``custom_vjp``):

* shrink: forward ``gmm``-NT; backward ``dx`` by the expand kernel on ``Aᵀ``, ``dA`` by the
  per-group reduction (``tgmm``), ``ds`` from the unscaled ``dA`` (``Σ dA_k ⊙ A_k``, in XLA);
* expand: forward ``gmm``-NN; backward ``dh`` by the shrink kernel on ``B``, ``dB`` by ``tgmm``,
  ``dacc = dy``.

Backends. TPU: Mosaic (scalar metadata in SMEM, lane-dense ``[K, R, D]`` weights, whole-rank
chunks, 128-multiple column tiles). GPU: **Triton, chosen explicitly** (Triton compiler params;
jax's default for a plain ``pallas_call`` would be Mosaic GPU): the kernels are small-rank grouped
matmuls written in the portable subset (grid + ``BlockSpec`` + ``fori_loop``); their Mosaic GPU
lowering stages whole blocks in shared memory (1.58 MB for a 64-row × 4096 tile plus ``A``, past
the H200's 227 KB) and needs warpgroup-sized copies, i.e. a different kernel (``plgpu.kernel``,
TMA pipelines) that only a device benchmark could justify. On GPU the rank is padded to a power
of two ≥ 16 (Triton's ``dot`` needs power-of-two operands ≥ 16). ``implementation="auto"`` on a
GPU/TPU target always runs these kernels (a tile that cannot be built raises).

Under a mesh whose batch axes (``data`` / ``fsdp``, or ``row_axes=``) shard the rows, each op runs
its kernel inside ``jax.shard_map`` over those axes (Mosaic / Triton kernels are not partitioned
by XLA), with the group sizes cut to each shard's rows; the weight gradients are summed over the
shards by ``shard_map``'s transpose.

References:
    Yan et al, `PLoRA: Efficient LoRA Hyperparameter Tuning for Large Models
    <https://arxiv.org/abs/2508.02932>`_, 2025.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels import _dispatch, _sharding
from pallas_kernels._dispatch import IMPLEMENTATIONS  # noqa: F401 (re-export)
from pallas_kernels._dispatch import next_pow2 as _next_pow2
from pallas_kernels._dispatch import resolve
from pallas_kernels.grouped_lora import kernel as _kernel
from pallas_kernels.grouped_lora import reference

#: TPU: bytes of one ``[block_m, D]`` row block the default ``block_m`` stays under (VMEM).
TPU_ROW_BLOCK_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Tiles of the grouped LoRA kernels (:func:`lora_shrink`, :func:`lora_expand`).

    Powers of two ≥ 8, checked once here (the tiling policy of :mod:`pallas_kernels._dispatch`).
    ``D`` is ``d_in`` for :func:`lora_shrink` and ``d_out`` for :func:`lora_expand`.

    Attributes:
        block_m: token rows per tile; the rows are padded to a multiple of the tile, which fits
            a shorter batch (:func:`~pallas_kernels._dispatch.fit_tile`). ``None``: 64 on GPU;
            on TPU 256, halved while a ``[block_m, D]`` fp32 block exceeds 2 MiB.
        block_r: rank chunk, skipped when ``≥ r_k`` (DERIVED: 16 is the bf16 MMA granularity);
            ``R ≤ block_r`` is one chunk, a larger ``R`` must be a multiple of ``block_r``. On
            TPU the rank is one chunk (the MXU is 128 wide: a skipped 16-column chunk saves
            nothing).
        block_k: chunk of the contraction over ``D`` (shrink forward, expand backward); it must
            divide ``D``. ``None``: the largest power of two ``≤ 128`` dividing ``D`` (else
            ``D`` up to 128, else an error); on TPU the whole ``D`` (a given tile must then be
            a multiple of 128).
        block_n: column tile over ``D`` (expand forward, the backward kernels); it must divide
            ``D``. ``None``: the largest power of two ``≤ 128`` dividing ``D``; on TPU the
            largest multiple of 128 ``≤ 512`` that does, else ``D`` itself.

    Example::

        >>> BlockSizes(block_m=16, block_r=8)
        BlockSizes(block_m=16, block_r=8, block_k=None, block_n=None)
    """

    block_m: int | None = None
    block_r: int = 16
    block_k: int | None = None
    block_n: int | None = None


class _Plan(NamedTuple):
    """Static tiles and backend of one call (hashable: a ``custom_vjp`` non-diff argument).

    ``r_pad`` / ``d_pad``: the rank and ``D`` the kernels see (GPU pads both so every Triton
    ``dot`` operand is a power of two ≥ 16; zero rows / columns change nothing).
    """

    block_m: int
    block_r: int
    block_k: int
    block_n: int
    r_pad: int
    d_pad: int
    platform: str
    interpret: bool


def _tpu_tile(op: str, name: str, block: int | None, dim: int, dim_name: str, cap: int) -> int:
    """A TPU lane tile over ``dim``: a multiple of 128 dividing it, or ``dim`` itself."""
    if block is None:
        return next((t for t in (512, 256, 128) if t <= cap and dim % t == 0 and t < dim), dim)
    tile = _dispatch.fit_dividing_tile(op, name, block, dim, dim_name)
    if tile != dim and tile % 128:
        raise ValueError(
            f"{op}: BlockSizes.{name}={block} is a lane tile on TPU and must be a multiple of 128 "
            f"(or cover {dim_name}={dim}); pass {name}=None or a multiple of 128 dividing {dim}.")
    return tile


def _plan(op: str, n: int, d: int, dim_name: str, r_max: int, blocks: BlockSizes,
          platform: str, interpret: bool) -> _Plan:
    if platform == "tpu":
        block_k = (d if blocks.block_k is None
                   else _tpu_tile(op, "block_k", blocks.block_k, d, dim_name, d))
        block_n = _tpu_tile(op, "block_n", blocks.block_n, d, dim_name, 512)
        block_m = blocks.block_m
        if block_m is None:
            block_m = 256
            while block_m > 16 and block_m * d * 4 > TPU_ROW_BLOCK_BYTES:
                block_m //= 2
        return _Plan(_dispatch.fit_tile(block_m, n), r_max, block_k, block_n, r_max, d,
                     platform, interpret)
    gpu = platform == "gpu"
    r_pad = max(16, _next_pow2(r_max)) if gpu else r_max
    d_pad = _round_up(d, 16) if gpu else d
    block_r = _dispatch.fit_dividing_tile(op, "block_r", blocks.block_r, r_pad,
                                          "the padded rank R")
    if blocks.block_k is None:
        block_k = _dispatch.dividing_tile(op, "block_k", 128, d_pad, dim_name)
    else:
        block_k = _dispatch.fit_dividing_tile(op, "block_k", blocks.block_k, d_pad, dim_name)
    if blocks.block_n is None:
        block_n = _dispatch.dividing_tile(op, "block_n", 128, d_pad, dim_name)
    else:
        block_n = _dispatch.fit_dividing_tile(op, "block_n", blocks.block_n, d_pad, dim_name)
    block_m = _dispatch.fit_tile(64 if blocks.block_m is None else blocks.block_m, n)
    if gpu:
        for name, tile in (("block_m", block_m), ("block_r", block_r), ("block_k", block_k),
                           ("block_n", block_n)):
            if tile < 16:
                raise ValueError(f"{op}: BlockSizes.{name}={tile} is a Triton dot operand on GPU "
                                 f"and must be >= 16; pass {name}=16 or more.")
    return _Plan(block_m, block_r, block_k, block_n, r_pad, d_pad, platform, interpret)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _meta(group_sizes, ranks, scale, k: int):
    """Offsets / ranks / scales padded to a power-of-two length ``≥ K + 1`` (Triton-friendly)."""
    size = _next_pow2(k + 1)
    gs = jnp.asarray(group_sizes, jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(gs)])
    offsets = jnp.pad(offsets, (0, size - k - 1), mode="edge")
    ranks = jnp.pad(jnp.asarray(ranks, jnp.int32), (0, size - k))
    scale = jnp.pad(jnp.asarray(scale, jnp.float32), (0, size - k))
    return offsets, ranks, scale


def _check(name: str, group_sizes, ranks, k: int) -> None:
    if jnp.shape(group_sizes) != (k,) or jnp.shape(ranks) != (k,):
        raise ValueError(
            f"{name}: group_sizes {jnp.shape(group_sizes)} and ranks {jnp.shape(ranks)} must both "
            f"have shape ({k},), one entry per adapter."
        )


def _pad(x, rows: int, cols: int | None = None):
    """Zero-pad the first axis of ``x`` to a multiple of ``rows`` and the last to ``cols``."""
    pad_rows = -x.shape[0] % rows
    pad_cols = 0 if cols is None else cols - x.shape[-1]
    if not pad_rows and not pad_cols:
        return x
    return jnp.pad(x, [(0, pad_rows)] + [(0, 0)] * (x.ndim - 2) + [(0, pad_cols)])


def _pad_weight(w, plan: _Plan):
    """``w [K, R, D]`` zero-padded to ``[K, r_pad, d_pad]``."""
    _, r, d = w.shape
    if (r, d) == (plan.r_pad, plan.d_pad):
        return w
    return jnp.pad(w, ((0, 0), (0, plan.r_pad - r), (0, plan.d_pad - d)))


def _nt(plan: _Plan, meta, x, w):
    """``[n, r_pad]``: the shrink kernel on ``x [n, D]`` and ``w [K, r_pad, d_pad]``."""
    offsets, ranks, scale = meta
    return _kernel.grouped_nt(offsets, ranks, scale, _pad(x, plan.block_m, plan.d_pad), w,
                              block_m=plan.block_m, block_r=plan.block_r, block_k=plan.block_k,
                              platform=plan.platform, interpret=plan.interpret)[:x.shape[0]]


def _nn(plan: _Plan, meta, h, w, d: int, acc=None, out_dtype=jnp.float32):
    """``[n, d]``: the expand kernel on ``h [n, R]`` and ``w [K, r_pad, d_pad]``."""
    offsets, ranks, scale = meta
    hp = _pad(h, plan.block_m, plan.r_pad)
    accp = None if acc is None else _pad(acc, plan.block_m, plan.d_pad)
    out = _kernel.grouped_nn(offsets, ranks, scale, hp, w, accp, block_m=plan.block_m,
                             block_r=plan.block_r, block_n=plan.block_n, platform=plan.platform,
                             interpret=plan.interpret, out_dtype=jnp.dtype(out_dtype))
    return out[:h.shape[0], :d]


def _tn(plan: _Plan, meta, lhs, rhs, num_groups: int, r_max: int, d: int):
    """``[K, r_max, d]``: the per-group reduction ``(lhs_k ⊙ m_k)ᵀ rhs_k``."""
    offsets, ranks, _ = meta
    out = _kernel.grouped_tn(offsets, ranks, _pad(lhs, plan.block_m, plan.r_pad),
                             _pad(rhs, plan.block_m, plan.d_pad), num_groups=num_groups,
                             block_m=plan.block_m, block_n=plan.block_n, platform=plan.platform,
                             interpret=plan.interpret)
    return out[:, :r_max, :d]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _shrink(x, a, group_sizes, scale, ranks, plan):
    return _shrink_fwd(x, a, group_sizes, scale, ranks, plan)[0]


def _shrink_fwd(x, a, group_sizes, scale, ranks, plan):
    k, _, r_max = a.shape
    meta = _meta(group_sizes, ranks, scale, k)
    a_t = _pad_weight(jnp.swapaxes(a, 1, 2), plan)  # [K, R, d_in]: d_in on the lanes
    h = _nt(plan, meta, x, a_t)[:, :r_max]
    return h, (x, a_t, meta, r_max)


def _shrink_bwd(plan, res, g):
    x, a_t, meta, r_max = res
    k, d_in = a_t.shape[0], x.shape[1]
    dx = _nn(plan, meta, g, a_t, d_in, out_dtype=x.dtype)  # s_k (g ⊙ m_k) A_kᵀ
    grad = _tn(plan, meta, g, x, k, r_max, d_in)  # (g_k ⊙ m_k)ᵀ x_k: dAᵀ before the scale
    scale = meta[2][:k]
    da = jnp.swapaxes(grad * scale[:, None, None], 1, 2).astype(a_t.dtype)
    ds = jnp.sum(grad * a_t[:, :r_max, :d_in].astype(jnp.float32), axis=(1, 2))
    return dx, da, None, ds, None


_shrink.defvjp(_shrink_fwd, _shrink_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _expand(h, b, group_sizes, ranks, acc, plan):
    return _expand_fwd(h, b, group_sizes, ranks, acc, plan)[0]


def _expand_fwd(h, b, group_sizes, ranks, acc, plan):
    k, _, d_out = b.shape
    meta = _meta(group_sizes, ranks, jnp.ones((k,), jnp.float32), k)
    b_p = _pad_weight(b, plan)
    return _nn(plan, meta, h, b_p, d_out, acc), (h, b_p, meta, acc, d_out)


def _expand_bwd(plan, res, g):
    h, b_p, meta, acc, d_out = res
    k, r_max = b_p.shape[0], h.shape[1]
    dh = _nt(plan, meta, g, b_p)[:, :r_max].astype(h.dtype)  # (g B_kᵀ) ⊙ m_k
    db = _tn(plan, meta, h, g, k, r_max, d_out).astype(b_p.dtype)  # (h_k ⊙ m_k)ᵀ g_k
    dacc = None if acc is None else g.astype(acc.dtype)
    return dh, db, None, None, dacc


_expand.defvjp(_expand_fwd, _expand_bwd)


def _local_sizes(group_sizes, rows: int, axes: tuple[str, ...]):
    """This shard's group sizes: the global groups cut to rows ``[i·rows, (i+1)·rows)``."""
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                               jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))])
    local = jnp.clip(offsets - _sharding.shard_index(axes) * rows, 0, rows)
    return jnp.diff(local)


def _run(op: str, fn, args, row_specs: Sequence[bool], n: int, row_axes, plan_for):
    """``fn(*args, plan)``: one kernel over all ``n`` rows, or one per shard of the rows under a
    mesh (``row_specs[i]``: argument ``i`` is split by rows; ``args[2]`` is ``group_sizes``).
    Rows are zero-padded to a multiple of the shard count; padded rows are in no group."""
    axes = _sharding.row_axes(op, row_axes)
    if not axes:
        return fn(*args, plan_for(n))
    shards = _sharding.axes_size(axes)
    args = [_sharding.pad_rows(x, shards) if split else x for x, split in zip(args, row_specs)]
    rows = args[0].shape[0] // shards
    plan = plan_for(rows)

    def body(*local):
        local = list(local)
        local[2] = _local_sizes(local[2], rows, axes)
        return fn(*local, plan)

    specs = [P(axes) if split else P() for split in row_specs]
    return _sharding.unpad_rows(_sharding.shard_map(body, args, specs, P(axes)), n)


def lora_shrink(
    x: Float[Array, "n d_in"],
    a: Float[Array, "k d_in r"],
    group_sizes: Int[Array, " k"],
    scale: Float[Array, " k"],
    ranks: Int[Array, " k"],
    *,
    implementation: Literal["auto", "pallas", "xla"] = "auto",
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    row_axes: str | Sequence[str] | None = None,
) -> Float[Array, "n r"]:
    """Grouped LoRA down-projection ``h = s_k (x A_k) ⊙ m_k`` for tokens sorted by adapter.

    Args:
        x: ``[N, d_in]`` rows sorted by group; a: ``[K, d_in, R]`` (R = padded rank).
        group_sizes: int32 ``[K]`` rows per group, ``sum ≤ N`` (a 0 is an empty slot).
        scale: ``[K]`` (``alpha_k / r_k``); ranks: int ``[K]`` true ranks, ``0 ≤ r_k ≤ R``.
        implementation, interpret: as every op (:mod:`pallas_kernels._dispatch`): ``"pallas"``
            (kernel), ``"xla"`` (``ragged_dot``), ``"auto"`` (kernel on GPU/TPU or with
            ``interpret=True``, XLA otherwise).
        block_sizes: the tiles (:class:`BlockSizes`); default ``BlockSizes()``.
        row_axes: mesh axes sharding the rows (the kernel then runs per shard in
            ``shard_map``); ``None``: the mesh's ``data`` / ``fsdp`` axes, ``()``: unsharded.

    Returns:
        ``[N, R]`` fp32; padded columns are exactly 0.

    Example::

        >>> import jax.numpy as jnp
        >>> h = lora_shrink(jnp.ones((5, 4)), jnp.ones((2, 4, 8)), jnp.array([2, 3]),
        ...                 jnp.ones(2), jnp.array([1, 8]), implementation="xla")
        >>> h.shape, float(h[0, 1])
        ((5, 8), 0.0)
    """
    k, d_in, r_max = a.shape
    blocks = BlockSizes.check("lora_shrink", block_sizes)
    _check("lora_shrink", group_sizes, ranks, k)
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ValueError(f"lora_shrink: x shape {x.shape} must be [N, {d_in}] (a is {a.shape}).")
    implementation, interpret = resolve(implementation, interpret, op="lora_shrink")
    if implementation == "xla":
        return reference.lora_shrink_reference(x, a, group_sizes, scale, ranks)
    platform = "interpret" if interpret else _dispatch.backend_platform()

    def plan_for(rows):
        return _plan("lora_shrink", rows, d_in, "d_in", r_max, blocks, platform, interpret)

    plan_for(x.shape[0])  # tile errors at trace time, before any shard_map
    args = (x, a, jnp.asarray(group_sizes, jnp.int32), jnp.asarray(scale, jnp.float32),
            jnp.asarray(ranks, jnp.int32))
    return _run("lora_shrink", _shrink, args, (True, False, False, False, False), x.shape[0],
                row_axes, plan_for)


def lora_expand(
    h: Float[Array, "n r"],
    b: Float[Array, "k r d_out"],
    group_sizes: Int[Array, " k"],
    ranks: Int[Array, " k"],
    acc: Float[Array, "n d_out"] | None = None,
    *,
    implementation: Literal["auto", "pallas", "xla"] = "auto",
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    row_axes: str | Sequence[str] | None = None,
) -> Float[Array, "n d_out"]:
    """Grouped LoRA up-projection ``y = acc + (h ⊙ m_k) B_k`` for tokens sorted by adapter.

    Args:
        h: ``[N, R]``; b: ``[K, R, d_out]``; group_sizes, ranks: int ``[K]``.
        acc: optional ``[N, d_out]`` added in the kernel (the base output; saves a pass).
        implementation, interpret, row_axes: as :func:`lora_shrink`.
        block_sizes: the tiles (:class:`BlockSizes`); default ``BlockSizes()``.

    Returns:
        ``[N, d_out]`` fp32.

    Example::

        >>> import jax.numpy as jnp
        >>> y = lora_expand(jnp.ones((3, 2)), jnp.ones((2, 2, 4)), jnp.array([1, 2]),
        ...                 jnp.array([1, 2]), implementation="xla")
        >>> y[:, 0].tolist()
        [1.0, 2.0, 2.0]
    """
    k, r_max, d_out = b.shape
    blocks = BlockSizes.check("lora_expand", block_sizes)
    _check("lora_expand", group_sizes, ranks, k)
    if h.ndim != 2 or h.shape[1] != r_max:
        raise ValueError(f"lora_expand: h shape {h.shape} must be [N, {r_max}] (b is {b.shape}).")
    if acc is not None and acc.shape != (h.shape[0], d_out):
        raise ValueError(f"lora_expand: acc shape {acc.shape} must be {(h.shape[0], d_out)}.")
    implementation, interpret = resolve(implementation, interpret, op="lora_expand")
    if implementation == "xla":
        return reference.lora_expand_reference(h, b, group_sizes, ranks, acc)
    platform = "interpret" if interpret else _dispatch.backend_platform()

    def plan_for(rows):
        return _plan("lora_expand", rows, d_out, "d_out", r_max, blocks, platform, interpret)

    plan_for(h.shape[0])
    args = (h, b, jnp.asarray(group_sizes, jnp.int32), jnp.asarray(ranks, jnp.int32))
    if acc is None:
        return _run("lora_expand", lambda h, b, gs, rk, plan: _expand(h, b, gs, rk, None, plan),
                    args, (True, False, False, False), h.shape[0], row_axes, plan_for)
    return _run("lora_expand", _expand, args + (acc,), (True, False, False, False, True),
                h.shape[0], row_axes, plan_for)


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "lora_expand", "lora_shrink"]
