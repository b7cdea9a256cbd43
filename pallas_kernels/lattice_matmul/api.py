"""Public UniSVQ matmul: ``y = x Wᵀ`` for a lattice-quantized ``W``, by kernel or by XLA.

.. math::
    W = \\mathrm{diag}(s_{out})\\, H_m^\\top C\\, H_n\\, \\mathrm{diag}(s_{in}),\\qquad
    C_{i,4g:4g+4} = A z_{i,g} + b

    y = s_{out} ⊙ H_m^\\top\\big(Z · x' + b^\\top Σ_g x_{r,g}\\big),\\quad
    x_r = H_n(s_{in} ⊙ x),\\quad x'_g = A^\\top x_{r,g}   \\;(\\text{"fold"})

Backends. TPU: Mosaic (the kernel's output and code chunks are 128-lane tiles, the affine
numbers scalars in SMEM). GPU: **Triton, chosen explicitly** (Triton compiler params; jax's
default for a plain ``pallas_call`` would be Mosaic GPU): the kernel is a 2-bit unpack + GEMM in
the portable subset, and its Mosaic GPU lowering copies whole ``[block, n/4]`` code and activation
blocks, which exceeds both the Hopper async-copy limit (≤ 256 elements per dimension) and shared
memory (607 KB at 4096 × 4096); a legal Mosaic GPU kernel would be a different, TMA-pipelined
design (``hopper_mixed_type_matmul_mgpu`` is the template) that only a device benchmark could
justify. ``implementation="auto"`` on a GPU/TPU target always runs the kernel (tiles that cannot
be built raise). Under a mesh the kernel runs per shard of the tokens (``data`` / ``fsdp``) and
of the output features (``tensor``) inside ``jax.shard_map``.

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Sequence

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, UInt

from pallas_kernels import _dispatch, _sharding
from pallas_kernels.lattice_matmul import reference
from pallas_kernels.lattice_matmul.kernel import lattice_planes_matmul
from pallas_kernels._dispatch import IMPLEMENTATIONS  # noqa: F401 (re-export)
from pallas_kernels._dispatch import inference_only, resolve

#: ``fold``: multiply the codes straight into x; ``dequant``: decode the weight tile first.
MODES = ("fold", "dequant")


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Tiles of the lattice matmul kernel (:func:`code_matmul`, :func:`lattice_matmul`).

    ``block_t`` tokens, ``block_m`` output rows and ``block_k`` packed code columns (4 weights
    each) per tile: powers of two ≥ 8, checked once here. The tiles do not change the result,
    so each fits a shorter axis (the one fit rule,
    :func:`~pallas_kernels._dispatch.fit_tile`) and the axes are zero-padded to a multiple of
    it (padded codes meet zero activations). These are not the Hadamard blocks
    ``block_in`` / ``block_out`` of :func:`lattice_matmul`, which belong to the weight.
    ``block_m=None`` (default) is 64 on GPU and 256 on TPU, where ``block_m`` (the output's
    lanes) and ``block_k`` (the codes' lanes) must be multiples of 128 or cover their axis.

    Example::

        >>> BlockSizes(block_m=16, block_k=32)
        BlockSizes(block_t=64, block_m=16, block_k=32)
    """

    block_t: int = 64
    block_m: int | None = None
    block_k: int = 128


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def code_matmul(
    x_rot: Float[Array, "t n"],
    codes: UInt[Array, "m q"],
    affine: Float[Array, "4 4"],
    offset: Float[Array, "4"],
    *,
    mode: Literal["fold", "dequant"] = "fold",
    implementation: Literal["auto", "pallas", "xla"] = "auto",
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    bits: int | None = None,
    row_axes: str | Sequence[str] | None = None,
) -> Float[Array, "t m"]:
    """Rotated-domain product ``x_rot @ Cᵀ`` (fp32), ``C`` decoded from 2-, 3- or 4-bit codes.

    Args:
        x_rot: rotated activations ``[t, n]`` (``n = 4·q``); bf16 or fp32.
        codes: packed codes ``[m, n/4]``: uint8 (2-bit digits) or uint16 (3- or 4-bit digits).
        affine: ``A [4, 4]``; offset: ``b [4]``.
        mode: ``"fold"`` (A onto the activations, integer-weight GEMM + rank-1 correction) or
            ``"dequant"`` (decode ``A z + b`` inside the kernel, float GEMM).
        implementation, interpret: as every op (:mod:`pallas_kernels._dispatch`): ``"auto"`` is
            the kernel on GPU/TPU (or with ``interpret=True``), the reference elsewhere. The
            kernel is inference-only: differentiate ``implementation="xla"``.
        block_sizes: the tiles (:class:`BlockSizes`: tokens, output rows, packed K chunk);
            default ``BlockSizes()``.
        bits: bits per digit (2, 3 or 4); ``None`` infers 2 (``uint8``) or 3 (``uint16``) from
            the dtype, so 4-bit codes must say ``bits=4``.
        row_axes: mesh axes sharding the tokens: the kernel then runs per shard inside
            ``shard_map`` (Pallas kernels are not partitioned by XLA); ``None``: the current
            mesh's ``data`` / ``fsdp`` axes (``pallas_kernels._sharding``), ``()``: unsharded.

    Returns:
        ``[t, m]`` fp32.

    Example::

        >>> import jax.numpy as jnp
        >>> codes = jnp.full((3, 2), 0b00011011, jnp.uint8)   # z = (0, 1, 2, 3) per group
        >>> y = code_matmul(jnp.ones((1, 8)), codes, jnp.eye(4), jnp.zeros(4), interpret=True)
        >>> y.tolist()
        [[12.0, 12.0, 12.0]]
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use 'fold' or 'dequant'.")
    t, n = x_rot.shape
    m, q = codes.shape
    if n != 4 * q:
        raise ValueError(
            f"x_rot has n={n} features but codes [{m}, {q}] encode {4 * q}; pass activations "
            "whose last dim is 4 × codes.shape[1]."
        )
    bits = reference.code_bits(codes, bits)  # explicit, or by dtype: uint8 2-bit, uint16 3-bit
    blocks = BlockSizes.check("code_matmul", block_sizes)
    impl, interpret = resolve(implementation, interpret, op="code_matmul")
    if impl == "xla":
        if mode == "fold":
            planes, correction = reference.fold_activations(x_rot, affine, offset)
            return reference.planes_matmul_reference(planes, codes, bits) + correction[:, None]
        return reference.code_matmul_reference(x_rot, codes, affine, offset, bits)

    platform = "interpret" if interpret else _dispatch.backend_platform()
    run = functools.partial(_code_matmul_kernel, mode=mode, blocks=blocks, bits=bits,
                            platform=platform, interpret=interpret)
    axes = _sharding.row_axes("code_matmul", row_axes)
    # the output features split over the mesh's tensor axis when they divide evenly (the
    # codes are sharded on their output axis by lowrank_jax.train.sharding)
    cols = tuple(a for a in _sharding.present_axes(_sharding.TENSOR_AXES)
                 if m % _sharding.axes_size((a,)) == 0)
    if not axes and not cols:
        return run(x_rot, codes, affine, offset)
    shards = _sharding.axes_size(axes)
    x_rot = _sharding.pad_rows(x_rot, shards)  # equal shards; the padding is sliced off
    _tiles(x_rot.shape[0] // shards, m // _sharding.axes_size(cols), q, blocks, platform)
    row_spec, col_spec = (axes or None), (cols or None)
    out = _sharding.shard_map(run, (x_rot, codes, affine, offset),
                              (P(row_spec), P(col_spec), P(), P()), P(row_spec, col_spec))
    return _sharding.unpad_rows(out, t)


def _tiles(t: int, m: int, q: int, blocks: BlockSizes, platform: str) -> tuple[int, int, int]:
    """``(block_t, block_m, block_k)`` for the padded axes; on TPU ``block_m`` (output lanes)
    and ``block_k`` (code lanes) must be multiples of 128 or cover their axis."""
    block_m = blocks.block_m or (256 if platform == "tpu" else 64)
    tiles = (_dispatch.fit_tile(blocks.block_t, t), _dispatch.fit_tile(block_m, m),
             _dispatch.fit_tile(blocks.block_k, q))
    if platform == "tpu":
        for name, tile, dim in (("block_m", tiles[1], m), ("block_k", tiles[2], q)):
            if tile % 128 and tile < dim:
                raise ValueError(
                    f"code_matmul: BlockSizes.{name}={tile} is a lane tile on TPU and must be a "
                    f"multiple of 128 (or cover the axis of {dim}); pass {name}=128 or more.")
    if platform == "gpu":
        for name, tile in zip(("block_t", "block_m", "block_k"), tiles):
            if tile < 16:
                raise ValueError(f"code_matmul: BlockSizes.{name}={tile} is a Triton dot operand "
                                 f"on GPU and must be >= 16; pass {name}=16 or more.")
    return tiles


def _code_matmul_kernel(x_rot, codes, affine, offset, *, mode, blocks, bits, platform,
                        interpret):
    """The Pallas path of :func:`code_matmul` on one shard of the tokens."""
    t, n = x_rot.shape
    m, q = codes.shape
    block_t, block_m, block_k = _tiles(t, m, q, blocks, platform)
    t_pad, m_pad = _round_up(t, block_t), _round_up(m, block_m)
    q_pad = _round_up(q, block_k)
    if mode == "fold":
        planes, correction = reference.fold_activations(x_rot, affine, offset)
        planes = planes.astype(x_rot.dtype)
    else:
        planes = jnp.moveaxis(x_rot.reshape(t, q, 4), -1, 0)
        correction = None
    planes = jnp.pad(planes, ((0, 0), (0, t_pad - t), (0, q_pad - q)))
    codes_p = jnp.pad(codes, ((0, m_pad - m), (0, q_pad - q)))
    ab = jnp.concatenate([affine.astype(jnp.float32).reshape(16),
                          offset.astype(jnp.float32).reshape(4), jnp.zeros((12,), jnp.float32)])
    kernel = functools.partial(lattice_planes_matmul, mode=mode, block_t=block_t,
                               block_m=block_m, block_k=block_k, interpret=interpret,
                               bits=bits, platform=platform)
    out = inference_only("code_matmul", kernel, planes, codes_p, ab)[:t, :m]
    # Padded codes decode to b in "dequant" mode, but their activations are 0: no effect.
    if correction is not None:
        out = out + correction[:, None]
    return out


def lattice_matmul(
    x: Float[Array, "... n"],
    codes: UInt[Array, "m q"],
    scale_in: Float[Array, " n"],
    scale_out: Float[Array, " m"],
    affine: Float[Array, "4 4"],
    offset: Float[Array, "4"],
    *,
    block_in: int,
    block_out: int,
    mode: Literal["fold", "dequant"] = "fold",
    implementation: Literal["auto", "pallas", "xla"] = "auto",
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    bits: int | None = None,
    row_axes: str | Sequence[str] | None = None,
) -> Float[Array, "... m"]:
    """``y = x @ Wᵀ`` for a UniSVQ weight, without ever forming ``W``.

    Input side: ``x_r = H_n (s_in ⊙ x)`` (block Hadamard of size ``block_in``); core:
    :func:`code_matmul`; output side: ``y = s_out ⊙ H_mᵀ(·)`` (block ``block_out``). The result
    equals :func:`reference.lattice_matmul_reference` (fp32 1e-5, bf16 2e-2 relative).

    Args:
        x: activations ``[..., n]``.
        codes, scale_in, scale_out, affine, offset: the quantized weight (see module doc).
        block_in, block_out: Hadamard block sizes on the input / output side.
        mode, implementation, interpret, block_sizes, bits, row_axes: see :func:`code_matmul`.

    Returns:
        ``[..., m]`` in ``x.dtype``.

    Example::

        >>> import jax.numpy as jnp
        >>> codes = jnp.zeros((4, 2), jnp.uint8)
        >>> y = lattice_matmul(jnp.ones((2, 8)), codes, jnp.ones(8), jnp.ones(4), jnp.eye(4),
        ...                    jnp.zeros(4), block_in=8, block_out=4)
        >>> y.shape
        (2, 4)
    """
    lead = x.shape[:-1]
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    x_rot = reference.block_hadamard(x2.astype(jnp.float32) * scale_in.astype(jnp.float32),
                                     block_in)
    out = code_matmul(
        x_rot.astype(x.dtype), codes, affine, offset, mode=mode,
        implementation=implementation, interpret=interpret, block_sizes=block_sizes, bits=bits,
        row_axes=row_axes,
    )
    y = reference.block_hadamard(out, block_out, transpose=True) * scale_out.astype(jnp.float32)
    return y.astype(x.dtype).reshape(*lead, codes.shape[0])


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "MODES", "code_matmul", "lattice_matmul"]
