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

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from lowrank_jax.quant.packing import vq_bits_per_weight
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    _ldlq,
    block_hadamard,
    block_ldl,
    inverse_rht,
    nearest_codeword,
    random_signs,
    rht,
)
from pallas_kernels.lattice_matmul.reference import hadamard_block_size


@functools.partial(jax.jit, static_argnames=("centroids", "iters"))
def kmeans(vectors: Float[Array, "p d"], key: Array, *, centroids: int = 256,
           iters: int = 15) -> Float[Array, "k d"]:
    """Lloyd's k-means (init: a random sample of the vectors; empty clusters keep their centre).

    Example::

        >>> import jax
        >>> c = kmeans(jax.random.normal(jax.random.PRNGKey(0), (1000, 4)), jax.random.PRNGKey(1),
        ...            centroids=16, iters=3)
        >>> c.shape
        (16, 4)
    """
    start = jax.random.choice(key, vectors.shape[0], (centroids,), replace=False)
    centres = vectors[start]

    def step(_, centres):
        idx = nearest_codeword(vectors, centres)
        onehot = jax.nn.one_hot(idx, centroids, dtype=vectors.dtype)
        counts = onehot.sum(axis=0)
        sums = onehot.T @ vectors
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts[:, None], 1), centres)

    return jax.lax.fori_loop(0, iters, step, centres)


def kmeans_vq_quantize(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    key: Array | None = None,
    iters: int = 15,
) -> tuple[Float[Array, "m n"], float]:
    """Quantize ``W [out, in]`` with a fitted 256×4 codebook; returns ``(Ŵ dense, bits/weight)``.

    Args:
        weight: ``[m, n]``, both divisible by 4.
        h: calibration Hessian of the unrotated inputs (``None``: plain nearest codeword).
        cfg: rotation block, ``tune_iters``, ``seed`` (as for UniSVQ).
        key: PRNG key (signs, k-means init).
        iters: Lloyd iterations.

    Returns:
        The dequantized weight (simulated storage) and the exact bits per weight of the format.

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
        >>> w_hat, bpw = kmeans_vq_quantize(w, None, UniSVQConfig(hadamard_block=32), iters=2)
        >>> w_hat.shape
        (32, 64)
    """
    m, n = weight.shape
    if m % 4 or n % 4:
        raise ValueError(f"weight shape {weight.shape}: both dims must be divisible by 4.")
    if m * n // 4 < 256:
        raise ValueError(
            f"weight shape {weight.shape} has {m * n // 4} 4-vectors, fewer than the 256 "
            "centroids; k-means VQ needs m·n ≥ 1024."
        )
    key = jax.random.PRNGKey(cfg.seed) if key is None else key
    k_out, k_in, k_km = jax.random.split(key, 3)
    block_out = hadamard_block_size(m, cfg.hadamard_block)
    block_in = hadamard_block_size(n, cfg.hadamard_block)
    s_out, s_in = random_signs(k_out, m), random_signs(k_in, n)
    w_rot = rht(weight.astype(jnp.float32), s_out, s_in, block_out, block_in)
    w_scale = jnp.sqrt(jnp.mean(w_rot * w_rot)) + 1e-12
    w_rot = w_rot / w_scale
    grid = kmeans(w_rot.reshape(-1, 4), k_km, centroids=256, iters=iters)
    if h is None or not cfg.use_hessian:
        idx = nearest_codeword(w_rot.reshape(m, n // 4, 4), grid)
        w_hat = grid[idx].reshape(m, n)
    else:
        h_rot = s_in[:, None] * h.astype(jnp.float32) * s_in[None, :]
        h_rot = block_hadamard(block_hadamard(h_rot, block_in).T, block_in).T
        h_rot = 0.5 * (h_rot + h_rot.T)
        lower, _ = block_ldl(h_rot)
        _, w_hat = _ldlq(w_rot, h_rot, lower, grid, cfg.tune_iters)
    w_hat = inverse_rht(w_hat * w_scale, s_out, s_in, block_out, block_in)
    return w_hat, vq_bits_per_weight(m, n)


__all__ = ["kmeans", "kmeans_vq_quantize"]
