"""The strongest scalar 2-bit baseline the library can build: RHT + LDLQ with per-group scales.

The same wrapper as UniSVQ (randomized block Hadamard rotation, RMS scale, the same calibration
Hessians, LDLQ + coordinate descent), but every weight is rounded **alone** onto a 4-level
uniform grid ``s_g·{−1.342, −0.447, 0.447, 1.342}`` (unit variance at ``s_g = 1``) whose scale
``s_g`` is one fp16 number per group of ``group_size`` consecutive input coordinates of a row.
This is GPTQ/QuIP-style scalar quantization in the incoherent basis (QuIP with per-group scales);
the grid is UniSVQ's lattice with ``A = I/σ`` per coordinate, so the only difference from UniSVQ's
rows is the codebook's structure and where the scale parameters live.

Each group's scale is the MSE-optimal multiple of its RMS over a small grid of candidates
(GPTQ's ``mse`` search), chosen before rounding.

Storage: 2-bit codes + one fp16 scale per group: ``2 + 16/group_size`` bits per weight exactly
(the Hadamard signs are regenerated from the stored seed, the block size is a shape rule).

References:
    Frantar et al, `GPTQ <https://arxiv.org/abs/2210.17323>`_, 2022.
    Chee et al, `QuIP <https://arxiv.org/abs/2307.13304>`_, 2023 (LDLQ, incoherence).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from lowrank_jax.quant.lattice import initial_lattice, make_grid
from lowrank_jax.quant.rounding import block_ldl, inverse_rht, ldlq, rotate_problem
from lowrank_jax.quant.packing import FLOAT_BITS
from lowrank_jax.quant.unisvq import UniSVQConfig
from pallas_kernels.lattice_matmul.reference import hadamard_block_size

SCALE_CANDIDATES = tuple(0.70 + 0.05 * i for i in range(17))  # × group RMS, 0.70 … 1.50


def sq_bits_per_weight(m: int, n: int, group_size: int, *, float_bits: int = FLOAT_BITS) -> float:
    """``2 + 16/group_size``: 2-bit codes and one fp16 scale per group.

    Example::

        >>> sq_bits_per_weight(576, 1536, 192)
        2.0833333333333335
    """
    return (2.0 * m * n + float_bits * m * (n // group_size)) / (m * n)


def check_sq_group(group_size: int, n: int) -> int:
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 4
            or group_size % 4 or n % group_size):
        raise ValueError(
            f"group_size={group_size!r} must be a multiple of 4 dividing the input dim {n}; "
            "e.g. 192 for SmolLM2 (576 and 1536)."
        )
    return group_size


def dividing_sq_group(group_size: int, dims) -> int:
    """The largest valid scalar-LDLQ group ``<= group_size`` for every input dim in ``dims``:
    a multiple of 4 dividing each of them (``group_size`` itself when it already does).

    Example::

        >>> dividing_sq_group(192, [576, 1536]), dividing_sq_group(192, [64, 128])
        (192, 64)
    """
    common = math.gcd(*(int(n) for n in dims))
    for g in range(min(group_size, common) // 4 * 4, 3, -4):
        if common % g == 0:
            return g
    raise ValueError(f"no multiple of 4 divides every input dim {sorted(set(dims))}.")


def group_scales(w_rot: Float[Array, "m n"], group_size: int) -> Float[Array, "m g"]:
    """Per-group scales (fp16-rounded) minimising plain rounding MSE over ``SCALE_CANDIDATES``."""
    m, n = w_rot.shape
    levels = make_grid(*initial_lattice())[:4, 3]  # the 4 scalar levels
    wg = w_rot.reshape(m, n // group_size, group_size)
    rms = jnp.sqrt(jnp.mean(wg * wg, axis=-1)) + 1e-12
    cand = rms[None] * jnp.asarray(SCALE_CANDIDATES)[:, None, None]  # c m g
    cand = cand.astype(jnp.float16).astype(jnp.float32)
    def err(s):
        q = levels[jnp.argmin(jnp.abs(wg[..., None] / s[..., None, None] - levels), axis=-1)]
        return jnp.sum((q * s[..., None] - wg) ** 2, axis=-1)
    errs = jax.vmap(err)(cand)
    return jnp.take_along_axis(cand, jnp.argmin(errs, axis=0)[None], axis=0)[0]


def sq_ldlq_quantize(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    cfg: UniSVQConfig = UniSVQConfig(),
    *,
    group_size: int = 192,
    key: Array | None = None,
) -> tuple[Float[Array, "m n"], float]:
    """Scalar 2-bit RHT + LDLQ of ``W [out, in]``; returns ``(Ŵ dense, bits/weight)``.

    Args:
        weight: ``[m, n]``, both divisible by 4.
        h: calibration Hessian of the unrotated inputs (``None``: plain rounding).
        cfg: rotation block, ``tune_iters``, ``use_hessian``, ``seed`` (as for UniSVQ).
        group_size: input coordinates per fp16 scale (a multiple of 4 dividing ``n``).
        key: PRNG key of the Hadamard signs.

    Returns:
        The dequantized weight (simulated storage) and the exact bits per weight.

    Example::

        >>> import jax
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (8, 32))
        >>> w_hat, bpw = sq_ldlq_quantize(w, None, UniSVQConfig(hadamard_block=8), group_size=16)
        >>> w_hat.shape, bpw
        ((8, 32), 3.0)
    """
    m, n = weight.shape
    if m % 4 or n % 4:
        raise ValueError(f"weight shape {weight.shape}: both dims must be divisible by 4.")
    check_sq_group(group_size, n)
    if h is not None and h.shape != (n, n):
        raise ValueError(f"hessian shape {h.shape} does not match the weight's n={n}.")
    key = jax.random.PRNGKey(cfg.seed) if key is None else key
    block_out = hadamard_block_size(m, cfg.hadamard_block)
    block_in = hadamard_block_size(n, cfg.hadamard_block)
    use_h = h is not None and cfg.use_hessian
    w_hat = _sq_core(weight, h if use_h else None, key, cfg.tune_iters, group_size, block_in,
                     block_out)
    return w_hat, sq_bits_per_weight(m, n, group_size)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _sq_core(weight, h, key, tune_iters, group_size, block_in, block_out):
    m, n = weight.shape
    w_rot, w_scale, s_in, s_out, h_rot = rotate_problem(weight, h, key, block_in, block_out)
    scales = group_scales(w_rot, group_size)  # m, n/group
    per4 = jnp.repeat(scales, group_size // 4, axis=1)  # m, n/4
    grid = make_grid(*initial_lattice())  # per-coordinate scalar rounding on the product grid
    if h_rot is None:
        idx_w = w_rot.reshape(m, n // 4, 4) / per4[..., None]
        levels = grid[:4, 3]
        q = levels[jnp.argmin(jnp.abs(idx_w[..., None] - levels), axis=-1)]
        w_hat = (q * per4[..., None]).reshape(m, n)
    else:
        lower, _ = block_ldl(h_rot)
        _, w_hat = ldlq(w_rot, h_rot, lower, grid, tune_iters=tune_iters, scales=per4)
    return inverse_rht(w_hat * w_scale, s_out, s_in, block_out, block_in)


__all__ = ["SCALE_CANDIDATES", "check_sq_group", "dividing_sq_group", "group_scales",
           "sq_bits_per_weight", "sq_ldlq_quantize"]
