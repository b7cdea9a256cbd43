"""2-bit codebooks of one weight matrix, compared at (about) equal bits: per-matrix UniSVQ, UniSVQ
with one lattice per row group, and the unconstrained 256×4 k-means codebook.

Every arm uses the same RHT, the same calibration Hessian and the same LDLQ (``cfg.tune_iters``)
and no block fine-tuning, so comparing them isolates the codebook:

* ``unisvq2``            — per-matrix ``A = step·O``, ``b`` (:func:`~.unisvq.quantize_linear`);
* ``unisvq2+refit``      — the same, ``A``, ``b`` refitted in closed form to the codes,
  re-rounded, refitted (``lattice_refit=2``);
* ``unisvq2-blocks``     — one lattice per output Hadamard block (``G = m / block_out``), refit 2;
* ``unisvq2-g48``        — 48 row groups (``20·48 = 960`` floats ≤ k-means' 1024), no refit;
* ``unisvq2-g48+refit``  — 48 row groups, refit 2;
* ``kmeans-vq2``         — 256×4 k-means codebook on the rotated 4-vectors (15 Lloyd iterations,
  :func:`~.kmeans_vq.kmeans_vq_weight`).
"""

from __future__ import annotations

from jaxtyping import Array, Float

from lowrank_jax.quant.kmeans_vq import kmeans_vq_weight, vq_dequantize
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    dequantize,
    quantize_linear,
    quantize_linear_grouped,
)
from pallas_kernels.lattice_matmul.reference import hadamard_block_size

CODEBOOK_ARMS = ("unisvq2", "unisvq2+refit", "unisvq2-blocks", "unisvq2-g48",
                 "unisvq2-g48+refit", "kmeans-vq2")


def codebook_arm(arm: str, w: Float[Array, "m n"], h: Float[Array, "n n"] | None,
                 cfg: UniSVQConfig, key: Array) -> tuple[Array, float]:
    """``(dequantized weight [m, n], exact bits per weight)`` of ``w`` under one arm of
    :data:`CODEBOOK_ARMS` (``cfg``: the Hadamard block and ``tune_iters``; ``h``: the
    calibration Hessian of the inputs, or ``None``).

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (16, 16))
        >>> w_hat, bpw = codebook_arm("unisvq2", w, None, UniSVQConfig(hadamard_block=8),
        ...                           jax.random.PRNGKey(1))
        >>> w_hat.shape, round(bpw, 4)
        ((16, 16), 5.25)
    """
    if arm not in CODEBOOK_ARMS:
        raise ValueError(f"arm={arm!r} is unknown; use one of {', '.join(CODEBOOK_ARMS)}.")
    if arm == "kmeans-vq2":
        q = kmeans_vq_weight(w, h, cfg, key=key, iters=15)
        return vq_dequantize(q), q.bits_per_weight()
    refit = 2 if arm.endswith("+refit") or arm == "unisvq2-blocks" else 0
    c = UniSVQConfig(hadamard_block=cfg.hadamard_block, tune_iters=cfg.tune_iters,
                     finetune_steps=0, lattice_refit=refit)
    if arm in ("unisvq2", "unisvq2+refit"):
        q = quantize_linear(w, h, c, key=key)
    else:
        m = w.shape[0]
        groups = m // hadamard_block_size(m, cfg.hadamard_block) if arm == "unisvq2-blocks" \
            else 48
        q = quantize_linear_grouped(w, h, c, groups=groups, key=key)
    return dequantize(q), q.bits_per_weight()


__all__ = ["CODEBOOK_ARMS", "codebook_arm"]
