"""Unconstrained k-means vector quantization (d = 4, 256 centroids): the VQ baseline of UniSVQ.

Same wrapper as UniSVQ (randomized Hadamard rotation, RMS scale, LDLQ with the calibration
Hessian), but the codebook is 256 free codewords fitted by Lloyd's k-means on the rotated weight's
4-vectors instead of the 20-number affine lattice ``A z + b``. The codebook costs
``256·4·16 = 16384`` bits per matrix (vs 320 for UniSVQ).

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026 (VQ comparison).
    Egiazarian et al, `AQLM <https://arxiv.org/abs/2401.06118>`_, 2024 (learned VQ codebooks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from lowrank_jax.quant.lattice import nearest_codeword
from lowrank_jax.quant.rounding import block_ldl, inverse_rht, ldlq, rotate_problem
from lowrank_jax.quant.packing import vq_bits_per_weight
from lowrank_jax.quant.unisvq import UniSVQConfig
from pallas_kernels.lattice_matmul.reference import hadamard_block_size

KMEANS_SAMPLE = 32768  # DERIVED: 4-vectors per k-means fit (128 per centroid). On a 1536x576
# matrix: 15 s instead of 34 s per matrix, proxy loss 0.0905 instead of 0.0886 (+2 %)


@functools.partial(jax.jit, static_argnames=("centroids", "iters", "sample"))
def codebook_kmeans(vectors: Float[Array, "p d"], key: Array, *, centroids: int = 256,
                    iters: int = 15, sample: int | None = None) -> Float[Array, "k d"]:
    """Lloyd's k-means (init: a random sample of the vectors; empty clusters keep their centre).

    ``sample`` (DERIVED speed rule): fit on a random subset of that many vectors (all when
    ``None`` or larger than ``p``); cluster sums and counts are ``segment_sum`` reductions, so
    no ``[p, k]`` one-hot matrix is built.

    Example::

        >>> import jax
        >>> c = codebook_kmeans(jax.random.normal(jax.random.PRNGKey(0), (1000, 4)),
        ...                     jax.random.PRNGKey(1), centroids=16, iters=3)
        >>> c.shape
        (16, 4)
    """
    k_init, k_sample = jax.random.split(key)
    if sample is not None and sample < vectors.shape[0]:
        vectors = vectors[jax.random.choice(k_sample, vectors.shape[0], (sample,),
                                            replace=False)]
    start = jax.random.choice(k_init, vectors.shape[0], (centroids,), replace=False)
    centres = vectors[start]

    def step(_, centres):
        idx = nearest_codeword(vectors, centres)
        counts = jax.ops.segment_sum(jnp.ones_like(idx, vectors.dtype), idx, centroids)
        sums = jax.ops.segment_sum(vectors, idx, centroids)
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts[:, None], 1), centres)

    return jax.lax.fori_loop(0, iters, step, centres)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VQWeight:
    """A k-means VQ matrix ``[m, n]``: ``W = diag(s_out) H_mᵀ C H_n diag(s_in)`` with
    ``C_{i,4g:4g+4} = codebook[codes[i, g]]`` (the UniSVQ layout with a free 256×4 table)."""

    codes: UInt8[Array, "m q"]
    codebook: Float[Array, "k 4"]
    scale_in: Float[Array, " n"]
    scale_out: Float[Array, " m"]
    block_in: int = dataclasses.field(metadata=dict(static=True), default=128)
    block_out: int = dataclasses.field(metadata=dict(static=True), default=128)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 4

    def bits_per_weight(self) -> float:
        return vq_bits_per_weight(*self.shape, centroids=self.codebook.shape[0])


def vq_dequantize(w: VQWeight) -> Float[Array, "m n"]:
    """Dense fp32 ``[m, n]`` of a :class:`VQWeight` (codebook gather + inverse RHT)."""
    m, n = w.shape
    c = w.codebook[w.codes.astype(jnp.int32)].reshape(m, n)
    return inverse_rht(c, w.scale_out, w.scale_in, w.block_out, w.block_in)


def kmeans_vq_weight(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    key: Array | None = None,
    iters: int = 15,
    sample: int | None = KMEANS_SAMPLE,
) -> VQWeight:
    """Quantize ``W [out, in]`` with a fitted 256×4 codebook (RHT + k-means + LDLQ).

    Args:
        weight: ``[m, n]``, both divisible by 4, ``m·n ≥ 1024``.
        h: calibration Hessian of the unrotated inputs (``None``: plain nearest codeword).
        cfg: rotation block, ``tune_iters``, ``use_hessian``, ``seed`` (as for UniSVQ).
        key: PRNG key (signs, k-means init).
        iters: Lloyd iterations.
        sample: 4-vectors the codebook is fitted on (a random subset; ``None``: all). The
            codes are then assigned to every vector by LDLQ.

    Returns:
        A :class:`VQWeight` (fp32 floats; the accounting counts them as fp16).

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
        >>> q = kmeans_vq_weight(w, None, UniSVQConfig(hadamard_block=32), iters=2)
        >>> vq_dequantize(q).shape, q.codebook.shape
        ((32, 64), (256, 4))
    """
    m, n = weight.shape
    if m % 4 or n % 4:
        raise ValueError(f"weight shape {weight.shape}: both dims must be divisible by 4.")
    if m * n // 4 < 256:
        raise ValueError(
            f"weight shape {weight.shape} has {m * n // 4} 4-vectors, fewer than the 256 "
            "centroids; k-means VQ needs m·n ≥ 1024."
        )
    if h is not None and h.shape != (n, n):
        raise ValueError(f"hessian shape {h.shape} does not match the weight's n={n}.")
    key = jax.random.PRNGKey(cfg.seed) if key is None else key
    block_out = hadamard_block_size(m, cfg.hadamard_block)
    block_in = hadamard_block_size(n, cfg.hadamard_block)
    use_h = h is not None and cfg.use_hessian
    codes, grid, s_in, s_out = _vq_core(weight, h if use_h else None, key, cfg.tune_iters,
                                        iters, block_in, block_out, sample)
    return VQWeight(codes, grid, s_in, s_out, block_in, block_out)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _vq_core(weight, h, key, tune_iters, iters, block_in, block_out, sample):
    m, n = weight.shape
    w_rot, w_scale, s_in, s_out, h_rot = rotate_problem(weight, h, key, block_in, block_out)
    grid = codebook_kmeans(w_rot.reshape(-1, 4), jax.random.split(key, 3)[2], centroids=256,
                           iters=iters, sample=sample)
    if h_rot is None:
        codes = nearest_codeword(w_rot.reshape(m, n // 4, 4), grid).astype(jnp.uint8)
    else:
        lower, _ = block_ldl(h_rot)
        codes, _ = ldlq(w_rot, h_rot, lower, grid, tune_iters=tune_iters)
    return codes, grid, s_in, s_out * w_scale


def kmeans_vq_quantize(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    key: Array | None = None,
    iters: int = 15,
    sample: int | None = KMEANS_SAMPLE,
) -> tuple[Float[Array, "m n"], float]:
    """:func:`kmeans_vq_weight` as ``(Ŵ dense, bits/weight)`` (simulated storage).

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
        >>> w_hat, bpw = kmeans_vq_quantize(w, None, UniSVQConfig(hadamard_block=32), iters=2)
        >>> w_hat.shape
        (32, 64)
    """
    q = kmeans_vq_weight(weight, h, cfg, key=key, iters=iters, sample=sample)
    return vq_dequantize(q), q.bits_per_weight()


__all__ = ["VQWeight", "codebook_kmeans", "kmeans_vq_quantize", "kmeans_vq_weight", "vq_dequantize"]
