"""Public grouped LoRA ops: ``lora_shrink`` / ``lora_expand`` by Pallas kernel or by XLA.

.. math::
    h_t = s_{k(t)}\\,(x_t A_{k(t)}) \\odot m_{k(t)},\\qquad
    y_t = \\mathrm{acc}_t + (h_t \\odot m_{k(t)}) B_{k(t)}

Rows are sorted by group (``group_sizes[k]`` consecutive rows for adapter ``k``); ``m_k`` masks
the padded rank slots ``r_k ≤ j < R``. Both ops are differentiable: the forward pass uses the
kernel, the backward pass is the VJP of the ``ragged_dot`` reference (a ``custom_vjp``; the
backward kernels — two tgmm-type reductions and two transposed gmms — are not written yet).

References:
    Yan et al, `PLoRA: Efficient LoRA Hyperparameter Tuning for Large Models
    <https://arxiv.org/abs/2508.02932>`_, 2025.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import _dispatch
from pallas_kernels.grouped_lora import kernel as _kernel
from pallas_kernels.grouped_lora import reference
from pallas_kernels._dispatch import IMPLEMENTATIONS  # noqa: F401 (re-export)
from pallas_kernels._dispatch import next_pow2 as _next_pow2
from pallas_kernels._dispatch import resolve


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Tiles of the grouped LoRA kernels (:func:`lora_shrink`, :func:`lora_expand`).

    Powers of two ≥ 8, checked once here (the tiling policy of :mod:`pallas_kernels._dispatch`).

    Attributes:
        block_m: token rows per tile; the rows are padded to a multiple of the tile, which fits
            a shorter batch (:func:`~pallas_kernels._dispatch.fit_tile`).
        block_r: rank chunk, skipped when ``≥ r_k`` (DERIVED: 16 is the bf16 MMA granularity);
            the padded rank ``R`` is not padded: ``R ≤ block_r`` is one chunk, a larger ``R``
            must be a multiple of ``block_r``.
        block_k: ``d_in`` chunk of :func:`lora_shrink`'s contraction; it must divide ``d_in``
            (``None``: the largest power of two ``≤ 512`` dividing ``d_in``, else ``d_in``
            itself up to 512; an error otherwise, never a silent whole-dimension tile; see
            :func:`~pallas_kernels._dispatch.dividing_tile`).
        block_n: output-column tile of :func:`lora_expand`; it must divide ``d_out`` (``None``:
            the largest power of two ``≤ 128`` dividing it, else ``d_out`` itself up to 128).

    Example::

        >>> BlockSizes(block_m=16, block_r=8)
        BlockSizes(block_m=16, block_r=8, block_k=None, block_n=None)
    """

    block_m: int = 64
    block_r: int = 16
    block_k: int | None = None
    block_n: int | None = None


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


def _pad_rows(x, block_m):
    n = x.shape[0]
    pad = -n % block_m
    return (jnp.pad(x, ((0, pad), (0, 0))) if pad else x), n


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _shrink_pallas(x, a, group_sizes, scale, ranks, block_m, block_r, block_k, interpret):
    offsets, rk, sc = _meta(group_sizes, ranks, scale, a.shape[0])
    xp, n = _pad_rows(x, block_m)
    out = _kernel.grouped_shrink(offsets, rk, sc, xp, a, block_m=block_m, block_r=block_r,
                                 block_k=block_k, interpret=interpret)
    return out[:n]


def _shrink_fwd(x, a, group_sizes, scale, ranks, block_m, block_r, block_k, interpret):
    out = _shrink_pallas(x, a, group_sizes, scale, ranks, block_m, block_r, block_k, interpret)
    return out, (x, a, group_sizes, scale, ranks)


def _shrink_bwd(block_m, block_r, block_k, interpret, res, g):
    x, a, group_sizes, scale, ranks = res
    _, vjp = jax.vjp(lambda x, a, s: reference.lora_shrink_reference(x, a, group_sizes, s, ranks),
                     x, a, scale)
    dx, da, ds = vjp(g)
    return dx, da, None, ds, None


_shrink_pallas.defvjp(_shrink_fwd, _shrink_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _expand_pallas(h, b, group_sizes, ranks, acc, block_m, block_n, block_r, interpret):
    offsets, rk, _ = _meta(group_sizes, ranks, jnp.ones_like(ranks, jnp.float32), b.shape[0])
    hp, n = _pad_rows(h, block_m)
    accp = None if acc is None else _pad_rows(acc, block_m)[0]
    out = _kernel.grouped_expand(offsets, rk, hp, b, accp, block_m=block_m, block_n=block_n,
                                 block_r=block_r, interpret=interpret)
    return out[:n]


def _expand_fwd(h, b, group_sizes, ranks, acc, block_m, block_n, block_r, interpret):
    out = _expand_pallas(h, b, group_sizes, ranks, acc, block_m, block_n, block_r, interpret)
    return out, (h, b, group_sizes, ranks, acc)


def _expand_bwd(block_m, block_n, block_r, interpret, res, g):
    h, b, group_sizes, ranks, acc = res
    _, vjp = jax.vjp(lambda h, b: reference.lora_expand_reference(h, b, group_sizes, ranks), h, b)
    dh, db = vjp(g)
    dacc = None if acc is None else g.astype(acc.dtype)
    return dh, db, None, None, dacc


_expand_pallas.defvjp(_expand_fwd, _expand_bwd)


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
) -> Float[Array, "n r"]:
    """Grouped LoRA down-projection ``h = s_k (x A_k) ⊙ m_k`` for tokens sorted by adapter.

    Args:
        x: ``[N, d_in]`` rows sorted by group; a: ``[K, d_in, R]`` (R = padded rank).
        group_sizes: int32 ``[K]`` rows per group, ``sum ≤ N`` (a 0 is an empty slot).
        scale: ``[K]`` (``alpha_k / r_k``); ranks: int ``[K]`` true ranks, ``0 ≤ r_k ≤ R``.
        implementation, interpret: as every op (:mod:`pallas_kernels._dispatch`): ``"pallas"``
            (kernel), ``"xla"`` (``ragged_dot``), ``"auto"`` (kernel on GPU/TPU or with
            ``interpret=True``, XLA otherwise).
        block_sizes: the tiles (:class:`BlockSizes`: ``block_m``, ``block_r``, ``block_k``);
            default ``BlockSizes()``.

    Returns:
        ``[N, R]`` fp32; padded columns are exactly 0.

    Example::

        >>> import jax.numpy as jnp
        >>> h = lora_shrink(jnp.ones((5, 4)), jnp.ones((2, 4, 8)), jnp.array([2, 3]),
        ...                 jnp.ones(2), jnp.array([1, 8]), implementation="xla")
        >>> h.shape, float(h[0, 1])
        ((5, 8), 0.0)
    """
    k, _, r_max = a.shape
    blocks = BlockSizes.check("lora_shrink", block_sizes)
    block_r = _dispatch.fit_dividing_tile("lora_shrink", "block_r", blocks.block_r, r_max,
                                          "the padded rank R")
    _check("lora_shrink", group_sizes, ranks, k)
    implementation, interpret = resolve(implementation, interpret, op="lora_shrink")
    if implementation == "xla":
        return reference.lora_shrink_reference(x, a, group_sizes, scale, ranks)
    d_in = x.shape[1]
    if blocks.block_k is None:
        block_k = _dispatch.dividing_tile("lora_shrink", "block_k", 512, d_in, "d_in")
    else:
        block_k = _dispatch.fit_dividing_tile("lora_shrink", "block_k", blocks.block_k, d_in,
                                              "d_in")
    block_m = _dispatch.fit_tile(blocks.block_m, x.shape[0])
    return _shrink_pallas(x, a, group_sizes, jnp.asarray(scale, jnp.float32), ranks, block_m,
                          block_r, block_k, interpret)


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
) -> Float[Array, "n d_out"]:
    """Grouped LoRA up-projection ``y = acc + (h ⊙ m_k) B_k`` for tokens sorted by adapter.

    Args:
        h: ``[N, R]``; b: ``[K, R, d_out]``; group_sizes, ranks: int ``[K]``.
        acc: optional ``[N, d_out]`` added in the kernel (the base output; saves a pass).
        implementation, interpret: as :func:`lora_shrink`.
        block_sizes: the tiles (:class:`BlockSizes`: ``block_m``, ``block_r``, ``block_n``);
            default ``BlockSizes()``.

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
    block_r = _dispatch.fit_dividing_tile("lora_expand", "block_r", blocks.block_r, r_max,
                                          "the padded rank R")
    _check("lora_expand", group_sizes, ranks, k)
    if acc is not None and acc.shape != (h.shape[0], d_out):
        raise ValueError(f"lora_expand: acc shape {acc.shape} must be {(h.shape[0], d_out)}.")
    implementation, interpret = resolve(implementation, interpret, op="lora_expand")
    if implementation == "xla":
        return reference.lora_expand_reference(h, b, group_sizes, ranks, acc)
    if blocks.block_n is None:
        block_n = _dispatch.dividing_tile("lora_expand", "block_n", 128, d_out, "d_out")
    else:
        block_n = _dispatch.fit_dividing_tile("lora_expand", "block_n", blocks.block_n, d_out,
                                              "d_out")
    block_m = _dispatch.fit_tile(blocks.block_m, h.shape[0])
    return _expand_pallas(h, b, group_sizes, ranks, acc, block_m, block_n, block_r, interpret)


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "lora_expand", "lora_shrink"]
