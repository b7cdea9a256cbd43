"""Pallas kernel: fused 2-bit unpack (+ affine decode) + matmul in the UniSVQ rotated domain.

Codes are ``uint8`` (2-bit digits) or ``uint16`` (3-bit digits in the low 12 bits, or 4-bit
digits in all 16); the digit width is a static argument (``bits``), see ``reference.code_bits``.

Portable subset only (``pallas_call``, ``BlockSpec`` grid, ``fori_loop``, ref slicing), so the same
body lowers with Mosaic on TPU, with Triton on GPU and runs in interpret mode on CPU
(``platform=``). TPU: the 20 affine numbers are read as scalars from SMEM, output tiles are
lane-dense (``block_m`` a multiple of 128 or the whole padded ``m``), and the packed-K chunk
offsets are multiples of 128 lanes. GPU: Triton, selected explicitly by its compiler params
(``pallas_kernels.lattice_matmul.api`` says why).

Two modes over the same planar activation layout ``x_planes [4, t, n/4]``:

* ``"fold"``: ``out = Σ_k x_planes[k] @ z_kᵀ`` — an unsigned-2-bit × float GEMM; the affine map was
  moved onto the activations (:func:`reference.fold_activations`), so no float weight is formed.
* ``"dequant"``: ``out = Σ_j x_planes[j] @ (Σ_k A[j,k] z_k + b_j)ᵀ`` — decode the codewords in
  registers from the 20 affine numbers, then a float GEMM.

Grid ``(t / block_t, m / block_m)``; each program loops over the packed K axis in chunks of
``block_k`` codes (``4·block_k`` weights) and accumulates in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, UInt


def _lattice_kernel(x_ref, codes_ref, ab_ref, out_ref, *, block_k: int, num_k: int, mode: str,
                    bits: int):
    block_t = x_ref.shape[1]
    block_m = codes_ref.shape[0]
    dims = (((1,), (1,)), ((), ()))
    if mode == "dequant":  # A (row-major, 16 numbers) then b (4), read once as scalars
        affine = [[ab_ref[4 * j + k] for k in range(4)] for j in range(4)]
        offset = [ab_ref[16 + j] for j in range(4)]

    def body(kk, acc):
        start = kk * block_k if isinstance(kk, int) else pl.multiple_of(kk * block_k, block_k)
        window = pl.ds(start, block_k)
        codes = codes_ref[:, window].astype(jnp.int32)
        digits = [(codes >> (bits * (3 - j))) & ((1 << bits) - 1) for j in range(4)]
        for j in range(4):
            x = x_ref[j, :, window]
            if mode == "fold":
                w = digits[j].astype(x.dtype)
            else:
                w = offset[j] + affine[j][0] * digits[0].astype(jnp.float32)
                for k in range(1, 4):
                    w = w + affine[j][k] * digits[k].astype(jnp.float32)
                w = w.astype(x.dtype)
            acc = acc + jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
        return acc

    zero = jnp.zeros((block_t, block_m), jnp.float32)
    acc = body(0, zero) if num_k == 1 else jax.lax.fori_loop(0, num_k, body, zero)
    out_ref[...] = acc.astype(out_ref.dtype)


def _compiler_params(platform: str):
    """Mosaic (both grid axes parallel) on TPU; Triton params on GPU, which select Triton over
    jax's default Mosaic GPU lowering of a plain ``pallas_call``."""
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return None


def _scalar_spec(platform: str):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((32,), lambda i, j: (0,))


@functools.partial(
    jax.jit,
    static_argnames=("mode", "block_t", "block_m", "block_k", "interpret", "bits", "platform"),
)
def lattice_planes_matmul(
    x_planes: Float[Array, "4 t q"],
    codes: UInt[Array, "m q"],
    affine_offset: Float[Array, "32"],
    *,
    mode: str = "fold",
    block_t: int = 16,
    block_m: int = 64,
    block_k: int = 128,
    interpret: bool = False,
    bits: int = 2,
    platform: str = "interpret",
) -> Float[Array, "t m"]:
    """Run the kernel on padded operands (``t % block_t == m % block_m == q % block_k == 0``).

    ``affine_offset [32]`` holds ``A`` row-major (0-15), then ``b`` (16-19), then zeros (a
    power-of-two size for Triton). ``platform``: ``"tpu"``, ``"gpu"`` or ``"interpret"``.
    Returns fp32 ``[t, m]``.
    """
    _, t, q = x_planes.shape
    m = codes.shape[0]
    if t % block_t or m % block_m or q % block_k:
        raise ValueError(
            f"padded shapes t={t}, m={m}, q={q} must be multiples of block_t={block_t}, "
            f"block_m={block_m}, block_k={block_k}; call pallas_kernels.lattice_matmul.api."
        )
    if bits not in (2, 3, 4):
        raise ValueError(f"bits={bits}: the lattice kernel decodes 2-, 3- or 4-bit digits.")
    kernel = functools.partial(_lattice_kernel, block_k=block_k, num_k=q // block_k, mode=mode,
                               bits=bits)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t, m), jnp.float32),
        grid=(t // block_t, m // block_m),
        in_specs=[
            pl.BlockSpec((4, block_t, q), lambda i, j: (0, i, 0)),
            pl.BlockSpec((block_m, q), lambda i, j: (j, 0)),
            _scalar_spec(platform),
        ],
        out_specs=pl.BlockSpec((block_t, block_m), lambda i, j: (i, j)),
        compiler_params=_compiler_params(platform),
        interpret=interpret,
        name=f"lattice_{mode}_matmul",
    )(x_planes, codes, affine_offset)


__all__ = ["lattice_planes_matmul"]
