"""Hessian-aware rounding in a rotated basis: Hadamard rotation, calibration Hessians, LDLQ.

Every rotated quantizer of :mod:`lowrank_jax.quant` (UniSVQ's lattice, the k-means VQ baseline,
the scalar LDLQ baseline) shares one wrapper around its codebook:

1. :func:`rotate_problem`: a randomized block Hadamard transform (:func:`rht`) of the weight,
   scaled to unit RMS, and the calibration Hessian (:func:`hessian`) in the rotated basis;
2. :func:`ldlq`: Hessian-aware rounding (LDLQ, the block-LDL form of GPTQ's error feedback) onto
   the codebook, then block coordinate descent; :func:`ldlq_quantize` is the checked entry
   point for one lattice ``A z + b``;
3. :func:`inverse_rht` back to the original basis; :func:`proxy_loss` scores the result.

References:
    Chee et al, `QuIP: 2-Bit Quantization of Large Language Models With Guarantees
    <https://arxiv.org/abs/2307.13304>`_, 2023 (LDLQ, incoherence processing).
    Tseng et al, `QuIP#: Even Better LLM Quantization with Hadamard Incoherence and Lattice
    Codebooks <https://arxiv.org/abs/2402.04396>`_, 2024.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt

from lowrank_jax.quant.lattice import (
    code_dtype,
    make_grid,
    nearest_codeword,
    round_to_lattice,
)
from pallas_kernels.lattice_matmul.reference import block_hadamard, unpack_codes


def random_signs(key: Array, dim: int) -> Float[Array, " dim"]:
    """``dim`` independent fair ``±1`` signs (fp32): the random diagonal of the RHT."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (dim,)), 1.0, -1.0).astype(jnp.float32)


def rht(
    weight: Float[Array, "m n"], signs_out: Float[Array, " m"], signs_in: Float[Array, " n"],
    block_out: int, block_in: int,
) -> Float[Array, "m n"]:
    """Randomized Hadamard transform ``W_r = H_m diag(σ_out) W diag(σ_in) H_nᵀ``."""
    w = signs_out[:, None] * weight.astype(jnp.float32) * signs_in[None, :]
    w = block_hadamard(w, block_in)  # W H_nᵀ
    return block_hadamard(w.T, block_out).T  # H_m (·)


def inverse_rht(
    weight_rot: Float[Array, "m n"], signs_out: Float[Array, " m"], signs_in: Float[Array, " n"],
    block_out: int, block_in: int,
) -> Float[Array, "m n"]:
    """Inverse of :func:`rht` (the Hadamards are orthogonal and symmetric)."""
    w = block_hadamard(weight_rot.astype(jnp.float32), block_in, transpose=True)
    w = block_hadamard(w.T, block_out, transpose=True).T
    return signs_out[:, None] * w * signs_in[None, :]


def hessian(x: Float[Array, "... n"], *, damp: float = 1e-2) -> Float[Array, "n n"]:
    """Calibration Hessian ``E[x xᵀ] + damp·mean(diag)·I`` (fp32) of a layer's inputs.

    DERIVED: the code accumulates ``E[xxᵀ] − μμᵀ`` and adds ``μμᵀ`` back, i.e. ``E[xxᵀ]``.
    """
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    h = x2.T @ x2 / x2.shape[0]
    return h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(h.shape[0])


def block_ldl(h: Float[Array, "n n"], block: int = 4) -> tuple[Array, Array]:
    """``H = L D Lᵀ`` with ``L`` unit block-lower-triangular and ``D`` block-diagonal (4×4 blocks).

    From the Cholesky factor ``H = C Cᵀ``: ``L = C·blockdiag(C_kk)⁻¹`` and
    ``D = blockdiag(C_kk C_kkᵀ)``.
    """
    n = h.shape[0]
    c = jnp.linalg.cholesky(h.astype(jnp.float32))
    g = n // block
    diag_blocks = c.reshape(g, block, g, block)[jnp.arange(g), :, jnp.arange(g), :]  # g b b
    inv_blocks = jnp.linalg.inv(diag_blocks)
    lower = jnp.einsum("ngj,gjk->ngk", c.reshape(n, g, block), inv_blocks).reshape(n, n)
    d = jnp.einsum("gij,gkj->gik", diag_blocks, diag_blocks)
    return lower, d


def proxy_loss(weight: Array, weight_hat: Array, h: Array) -> Array:
    """``tr((Ŵ−W) H (Ŵ−W)ᵀ) / tr(W H Wᵀ)``: relative output error on the calibration inputs."""
    e = (weight_hat - weight).astype(jnp.float32)
    return jnp.sum((e @ h) * e) / jnp.sum((weight @ h) * weight)


@functools.partial(jax.jit, static_argnames=("tune_iters", "bits"))
def ldlq(
    weight: Float[Array, "m n"],
    h: Float[Array, "n n"],
    lower: Float[Array, "n n"],
    grid: Float[Array, "k 4"] | None = None,
    *,
    tune_iters: int = 10,
    scales: Float[Array, "m q"] | None = None,
    lattice: tuple[Array, Array] | None = None,
    bits: int = 2,
) -> tuple[Array, Float[Array, "m n"]]:
    r"""LDLQ + coordinate descent of ``weight`` onto a 4-dimensional codebook: the rounding core
    shared by UniSVQ, k-means VQ and the scalar LDLQ baseline (:func:`ldlq_quantize` is the
    checked entry point for one lattice).

    The 4-column groups ``k`` are rounded last to first, each after feeding back the error of
    the groups already rounded through the block-LDL factor ``lower`` of ``h``
    (:func:`block_ldl`), then ``tune_iters`` sweeps of block coordinate descent re-round every
    group against the full Hessian:

    .. math::
        \tilde w_k = w_k + (W - \hat W)\, L_{:, k},\qquad
        \hat w_k ← \mathrm{round}\big(\hat w_k + (W - \hat W) H_{:,k} H_{kk}^{-1}\big)

    Three codebooks: ``grid [k, 4]`` (exhaustive nearest codeword); ``grid`` with ``scales
    [m, n/4]`` (the codebook multiplied per row and 4-column group: per-group scalar scales);
    ``lattice=(A, b)`` with a scaled orthogonal ``A`` (exact coordinate rounding by
    :func:`~lowrank_jax.quant.lattice.round_to_lattice`, ``grid`` unused).

    Args:
        weight: the (rotated) weight ``W [m, n]``, ``n % 4 == 0``, fp32.
        h: its SPD Hessian ``[n, n]`` (fp32).
        lower: ``L`` of ``h = L D Lᵀ`` (:func:`block_ldl`).
        grid: codewords ``[k, 4]``, or ``None`` with ``lattice``.
        tune_iters: coordinate-descent sweeps after LDLQ (static).
        scales: optional per-row, per-group multipliers of ``grid``.
        lattice: optional ``(A [4, 4], b [4])``, rounded to instead of searching ``grid``.
        bits: digit width of the codes (static): their dtype, and the lattice for ``lattice``.

    Returns:
        ``(codes [m, n/4], weight_hat [m, n])``: the codeword indices (``uint8`` for 2 bits,
        ``uint16`` for 3 or 4) and the rounded weight.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from lowrank_jax.quant.lattice import initial_lattice
        >>> a, b = initial_lattice()
        >>> w = jax.random.normal(jax.random.PRNGKey(0), (3, 8))
        >>> h = jnp.eye(8)
        >>> codes, w_hat = ldlq(w, h, block_ldl(h)[0], make_grid(a, b))
        >>> codes.shape, bool(jnp.allclose(w_hat, make_grid(a, b)[codes].reshape(3, 8)))
        ((3, 2), True)
    """
    w = weight
    m, n = w.shape
    groups = n // 4

    def round_group(target, k):
        if lattice is not None:
            idx = round_to_lattice(target, lattice[0], lattice[1], bits)
            z = unpack_codes(idx.astype(code_dtype(bits))[:, None], bits)[:, 0]
            z = z.astype(jnp.float32)
            return idx, z @ lattice[0].T + lattice[1]
        if scales is None:
            idx = nearest_codeword(target, grid)
            return idx, grid[idx]
        sk = jax.lax.dynamic_slice(scales, (0, k), (m, 1))
        idx = nearest_codeword(target / sk, grid)
        return idx, grid[idx] * sk

    def ldl_step(t, carry):
        w_hat, err, idx_all = carry
        k = groups - 1 - t
        lk = jax.lax.dynamic_slice(lower, (0, 4 * k), (n, 4))
        wk = jax.lax.dynamic_slice(w, (0, 4 * k), (m, 4))
        idx, c = round_group(wk + err @ lk, k)
        w_hat = jax.lax.dynamic_update_slice(w_hat, c, (0, 4 * k))
        err = jax.lax.dynamic_update_slice(err, wk - c, (0, 4 * k))
        idx_all = jax.lax.dynamic_update_slice(idx_all, idx[:, None].astype(jnp.int32), (0, k))
        return w_hat, err, idx_all

    init = (jnp.zeros_like(w), jnp.zeros_like(w), jnp.zeros((m, groups), jnp.int32))
    w_hat, _, idx_all = jax.lax.fori_loop(0, groups, ldl_step, init)

    def tune_step(k, carry):
        w_hat, idx_all = carry
        hk = jax.lax.dynamic_slice(h, (0, 4 * k), (n, 4))
        hkk = jax.lax.dynamic_slice(h, (4 * k, 4 * k), (4, 4))
        cur = jax.lax.dynamic_slice(w_hat, (0, 4 * k), (m, 4))
        target = cur + ((w - w_hat) @ hk) @ jnp.linalg.inv(hkk)
        idx, c = round_group(target, k)
        w_hat = jax.lax.dynamic_update_slice(w_hat, c, (0, 4 * k))
        idx_all = jax.lax.dynamic_update_slice(idx_all, idx[:, None].astype(jnp.int32), (0, k))
        return w_hat, idx_all

    def tune_pass(_, carry):
        return jax.lax.fori_loop(0, groups, tune_step, carry)

    w_hat, idx_all = jax.lax.fori_loop(0, tune_iters, tune_pass, (w_hat, idx_all))
    return idx_all.astype(code_dtype(bits)), w_hat


def ldlq_quantize(
    weight_rot: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    affine: Float[Array, "4 4"],
    offset: Float[Array, "4"],
    *,
    tune_iters: int = 10,
    bits: int = 2,
) -> UInt[Array, "m q"]:
    """Hessian-aware rounding of ``W_r`` onto the lattice ``A z + b`` (LDLQ + coordinate descent).

    .. math::
        H = L D L^\\top,\\quad \\tilde w_k = w_k + (W - \\hat W)_{:, >k} L_{>k, k},\\quad
        \\hat w_k = \\mathrm{nearest}(\\tilde w_k)\\;(k = \\text{last} … \\text{first})

    then ``tune_iters`` sweeps of ``ŵ_k ← nearest(ŵ_k + (W − Ŵ) H_{:,k} H_{kk}⁻¹)``. With
    ``h=None`` (or ``H = I``) this is independent nearest-codeword rounding.

    Args:
        weight_rot: rotated, unit-RMS weight ``[m, n]`` (``n % 4 == 0``).
        h: Hessian of the rotated inputs ``[n, n]`` (SPD), or ``None``.
        affine, offset: the lattice ``A``, ``b``.
        tune_iters: coordinate-descent passes.
        bits: lattice digit width, 2 (``{0..3}⁴``), 3 (``{0..7}⁴``) or 4 (``{0..15}⁴``);
            exhaustive search over the ``16^bits`` codewords here (tiny shapes only for 4 bits;
            the quantizer itself rounds with :func:`round_to_lattice` for 3 and 4 bits).

    Returns:
        codes ``[m, n/4]``: ``uint8`` (2 bits) or ``uint16`` (3 or 4 bits).

    Example::

        >>> import jax
        >>> from lowrank_jax.quant.lattice import initial_lattice
        >>> a, b = initial_lattice()
        >>> ldlq_quantize(jax.random.normal(jax.random.PRNGKey(0), (3, 8)), None, a, b).shape
        (3, 2)
    """
    m, n = weight_rot.shape
    if n % 4:
        raise ValueError(f"weight has n={n} input features; UniSVQ needs n divisible by 4.")
    grid = make_grid(affine, offset, bits)
    w = weight_rot.astype(jnp.float32)
    if h is None:
        idx = nearest_codeword(w.reshape(m, n // 4, 4), grid)
        return idx.astype(code_dtype(bits))
    if h.shape != (n, n):
        raise ValueError(f"hessian shape {h.shape} does not match the weight's n={n}.")
    lower, _ = block_ldl(h)
    codes, _ = ldlq(w, h.astype(jnp.float32), lower, grid, tune_iters=tune_iters, bits=bits)
    return codes


def rotate_problem(weight: Float[Array, "m n"], h: Float[Array, "n n"] | None, key: Array,
                   block_in: int, block_out: int):
    """The shared wrapper of every rotated quantizer (UniSVQ, k-means VQ, scalar LDLQ).

    Returns ``(w_rot, w_scale, s_in, s_out, h_rot)``: the unit-RMS RHT of ``W`` (``W_r·w_scale =
    H_m diag(s_out) W diag(s_in) H_nᵀ``), the random signs (from ``key``'s first two splits) and
    the Hessian in the rotated input basis (``None`` if ``h`` is).
    """
    m, n = weight.shape
    k_out, k_in, _ = jax.random.split(key, 3)
    s_out, s_in = random_signs(k_out, m), random_signs(k_in, n)
    w_rot = rht(weight.astype(jnp.float32), s_out, s_in, block_out, block_in)
    w_scale = jnp.sqrt(jnp.mean(w_rot * w_rot)) + 1e-12
    h_rot = None
    if h is not None:
        h_rot = s_in[:, None] * h.astype(jnp.float32) * s_in[None, :]
        h_rot = block_hadamard(block_hadamard(h_rot, block_in).T, block_in).T  # H_n h H_nᵀ
        h_rot = 0.5 * (h_rot + h_rot.T)
    return w_rot / w_scale, w_scale, s_in, s_out, h_rot


__all__ = ["block_ldl", "hessian", "inverse_rht", "ldlq", "ldlq_quantize", "proxy_loss",
           "random_signs", "rht", "rotate_problem"]
