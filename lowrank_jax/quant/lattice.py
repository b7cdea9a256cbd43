"""The UniSVQ lattice codebook: ``A z + b`` over ``z ∈ {0..2^b − 1}⁴`` (``b`` = 2, 3 or 4 bits
per digit), its initial (scaled orthogonal) transform, the exhaustive nearest-codeword search
and the exact rounding shortcut for a scaled orthogonal ``A``; per-group lattices ``A_g z + b_g``
(:func:`decode_grouped`) and their closed-form refit to fixed codes (:func:`refit_lattice`).

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt

from pallas_kernels.lattice_matmul.reference import unpack_codes

LATTICE_SIGMA = math.sqrt(1.25)  # std of Uniform{0,1,2,3}
LATTICE_BITS = (2, 3, 4)  # bits per digit of the supported lattices ({0..3}⁴, {0..7}⁴, {0..15}⁴)


def check_lattice_bits(bits: int) -> int:
    """``bits`` if it is a supported lattice digit width, else a clear ``ValueError``."""
    if bits not in LATTICE_BITS:
        raise ValueError(f"bits={bits!r}: UniSVQ has 2-bit ({{0..3}}⁴), 3-bit ({{0..7}}⁴) and "
                         f"4-bit ({{0..15}}⁴) lattices; use one of {LATTICE_BITS}.")
    return bits


def lattice_sigma(bits: int = 2) -> float:
    """Standard deviation of ``Uniform{0, …, 2^bits − 1}``: ``sqrt((4^bits − 1)/12)``."""
    levels = 1 << check_lattice_bits(bits)
    return math.sqrt((levels * levels - 1) / 12.0)


def random_orthogonal(key: Array, dim: int = 4) -> Float[Array, "d d"]:
    """A Haar-random orthogonal matrix (QR of a Gaussian with the sign fix)."""
    q, r = jnp.linalg.qr(jax.random.normal(key, (dim, dim)))
    return q * jnp.sign(jnp.diag(r))[None, :]


# DERIVED: the step of the MSE-optimal 8-level uniform quantizer of a unit Gaussian (Max, 1960:
# 0.5860, MSE 0.0374). The unit-variance grid (step 1/σ = 0.436) clips the rotated weight's tails
# at ±1.75 and loses half of the third bit (measured on tiny shapes, the Hessian proxy loss is
# 2.1x lower than 2-bit's, against 3.3x with this step). 2 bits keep the unit-variance grid
# (step 0.894, near the optimal 0.996), as measured in the whole-model table.
GAUSSIAN_STEP_3BIT = 0.5860
# DERIVED likewise: the step of the MSE-optimal 16-level uniform quantizer of a unit Gaussian
# (Max, 1960: 0.3352, MSE 0.01154); the unit-variance grid would have step 0.217 and clip at ±1.63.
GAUSSIAN_STEP_4BIT = 0.3352


def initial_lattice(rotation: Float[Array, "4 4"] | None = None,
                    bits: int = 2) -> tuple[Array, Array]:
    """The lattice before fine-tuning, ``A = step·O``, ``b = −c·step·O·1`` with
    ``c = (2^bits − 1)/2`` (1.5, 3.5, 7.5): a grid centred on 0 with equal steps on every rotated
    axis.

    2 bits: ``step = 1/σ``, ``σ² = 1.25`` (unit-variance codewords); with ``O = I`` every
    coordinate takes the uniform 2-bit grid ``{−1.342, −0.447, 0.447, 1.342}``: scalar
    quantization is the special case of the lattice. 3 and 4 bits: ``step = 0.586`` and
    ``0.3352``, the MSE-optimal uniform steps for a unit Gaussian (:data:`GAUSSIAN_STEP_3BIT`,
    :data:`GAUSSIAN_STEP_4BIT`).

    Example::

        >>> a, b = initial_lattice()
        >>> sorted({round(float(v), 3) for v in make_grid(a, b)[:, 0]})
        [-1.342, -0.447, 0.447, 1.342]
    """
    o = jnp.eye(4) if rotation is None else jnp.asarray(rotation, jnp.float32)
    step = {2: 1.0 / lattice_sigma(2), 3: GAUSSIAN_STEP_3BIT,
            4: GAUSSIAN_STEP_4BIT}[check_lattice_bits(bits)]
    center = ((1 << bits) - 1) / 2.0
    return o * step, -center * step * (o @ jnp.ones(4))


def code_dtype(bits: int = 2):
    """Code dtype of a lattice: ``uint8`` (2-bit digits) or ``uint16`` (3- and 4-bit digits)."""
    return jnp.uint8 if check_lattice_bits(bits) == 2 else jnp.uint16


def all_digits(bits: int = 2) -> Int[Array, "k 4"]:
    """Digits of every code index ``0..16^bits − 1`` (first coordinate most significant)."""
    count = 1 << (4 * check_lattice_bits(bits))
    return unpack_codes(jnp.arange(count, dtype=jnp.int32).astype(code_dtype(bits))[None, :],
                        bits)[0]


def make_grid(affine: Float[Array, "4 4"], offset: Float[Array, "4"],
              bits: int = 2) -> Float[Array, "k 4"]:
    """All codewords ``A z + b`` (256, 4096 or 65536 for 2, 3, 4 bits), row ``idx`` for ``idx``."""
    return all_digits(bits).astype(jnp.float32) @ affine.astype(jnp.float32).T + offset


def round_to_lattice(
    w4: Float[Array, "... 4"], affine: Float[Array, "4 4"], offset: Float[Array, "4"],
    bits: int = 2,
) -> Int[Array, "..."]:
    """Nearest codeword index for a *scaled orthogonal* ``A = c·O`` (every lattice before
    fine-tuning, :func:`initial_lattice`), without enumerating the codebook.

    .. math::
        \\|w - (cOz + b)\\|^2 = c^2 \\|c^{-1}O^\\top(w - b) - z\\|^2
        \\;\\Rightarrow\\; z^* = \\mathrm{clip}(\\mathrm{round}(A^{-1}(w - b)), 0, 2^{bits} - 1)

    coordinate-wise (the box constraint separates under the identity metric), so it equals
    :func:`nearest_codeword` on :func:`make_grid` (up to ties) at ``O(4)`` instead of ``O(16^bits)``
    per vector. For a general ``A`` use :func:`nearest_codeword`.
    """
    levels = 1 << check_lattice_bits(bits)
    z = (w4.astype(jnp.float32) - offset) @ jnp.linalg.inv(affine.astype(jnp.float32)).T
    z = jnp.clip(jnp.round(z), 0, levels - 1).astype(jnp.int32)
    weights = jnp.asarray([levels ** (3 - j) for j in range(4)], jnp.int32)
    return jnp.sum(z * weights, axis=-1)


def nearest_codeword(w4: Float[Array, "... 4"], grid: Float[Array, "k 4"]) -> Int[Array, "..."]:
    """``argmin_c ‖w − c‖²`` over the codebook, computed as ``argmax (2 w·c − ‖c‖²)``."""
    score = 2.0 * jnp.einsum("...j,kj->...k", w4, grid) - jnp.sum(grid * grid, axis=-1)
    return jnp.argmax(score, axis=-1)


def refit_lattice(
    weight_rot: Float[Array, "m n"],
    h: Float[Array, "n n"] | None,
    codes: UInt[Array, "m q"],
    affine: Float[Array, "g 4 4"],
    offset: Float[Array, "g 4"],
    *,
    bits: int = 2,
    ridge: float = 1e-6,
) -> tuple[Array, Array]:
    r"""The ``A_g``, ``b_g`` minimising ``Σ_rows (C − W_r) H (C − W_r)ᵀ`` with the codes fixed.

    ``C[i, 4k:4k+4] = A_g z_{i,k} + b_g`` is linear in ``Θ_g = [A_g | b_g]`` (20 numbers), so each
    group's optimum solves the normal equations (``F_i[k] = [z_{i,k}, 1]``)

    .. math::
        \sum_{i∈g}\sum_{k,k'} F_i[k]_l\, H_{4k+j,4k'+j'}\, F_i[k']_{l'}\;Θ_{j'l'}
        = \sum_{i∈g}\sum_k F_i[k]_l\,(H w_i)_{4k+j}

    with a ridge ``ridge·tr/20`` towards the current ``Θ_g`` (digits a group never uses keep
    their value). ``h=None`` is ``H = I`` (plain least squares).

    Args:
        weight_rot: the rotated, scaled target ``W_r [m, n]``.
        h: rotated Hessian ``[n, n]`` or ``None``.
        codes: ``[m, n/4]`` lattice codes.
        affine, offset: current ``[G, 4, 4]``, ``[G, 4]`` (``G`` divides ``m``).
        bits: digit width of ``codes``.
        ridge: relative ridge of the solve.

    Returns:
        ``(affine [G, 4, 4], offset [G, 4])``.

    Example::

        >>> import jax.numpy as jnp
        >>> a, b = initial_lattice()
        >>> codes = jnp.arange(8, dtype=jnp.uint8).reshape(4, 2) * 31
        >>> w = decode_grouped(codes, a[None], b[None])  # exactly on the lattice
        >>> a2, b2 = refit_lattice(w, None, codes, a[None], b[None])
        >>> bool(jnp.allclose(a2[0], a, atol=1e-4))
        True
    """
    m, n = weight_rot.shape
    q = n // 4
    groups = affine.shape[0]
    w = weight_rot.astype(jnp.float32)
    z = unpack_codes(codes, bits).astype(jnp.float32)  # m q 4
    f = jnp.concatenate([z, jnp.ones((m, q, 1), jnp.float32)], -1)  # m q 5
    if h is None:
        gram = jnp.einsum("rkl,rkL->rlL", f, f)  # m 5 5, the same for every j
        gram = jnp.einsum("rlL,jJ->rjlJL", gram, jnp.eye(4))
        hw = w
    else:
        hr = h.astype(jnp.float32).reshape(q, 4, q, 4)
        t = jnp.einsum("rkl,kjKJ->rljKJ", f, hr)
        gram = jnp.einsum("rljKJ,rKL->rjlJL", t, f)
        hw = w @ h.astype(jnp.float32)
    rhs = jnp.einsum("rkl,rkj->rjl", f, hw.reshape(m, q, 4))
    gram = gram.reshape(groups, m // groups, 20, 20).sum(1)
    rhs = rhs.reshape(groups, m // groups, 20).sum(1)
    theta0 = jnp.concatenate([affine, offset[..., None]], -1).reshape(groups, 20)
    lam = ridge * jnp.trace(gram, axis1=1, axis2=2)[:, None] / 20 + 1e-30
    theta = jnp.linalg.solve(gram + lam[:, :, None] * jnp.eye(20),
                             (rhs + lam * theta0)[..., None])[..., 0].reshape(groups, 4, 5)
    return theta[..., :4], theta[..., 4]


def decode_grouped(
    codes: UInt[Array, "m q"], affine: Float[Array, "g 4 4"], offset: Float[Array, "g 4"],
    bits: int | None = None,
) -> Float[Array, "m n"]:
    """Rotated-domain ``C [m, n]`` with ``C[i, 4k:4k+4] = A_g z_{i,k} + b_g`` (``i`` in group
    ``g``; ``G`` contiguous groups of ``m/G`` rows)."""
    m, q = codes.shape
    groups = affine.shape[0]
    z = unpack_codes(codes, bits).astype(jnp.float32).reshape(groups, m // groups, q, 4)
    c = jnp.einsum("grqk,gjk->grqj", z, affine.astype(jnp.float32))
    c = c + offset.astype(jnp.float32)[:, None, None, :]
    return c.reshape(m, 4 * q)


__all__ = [
    "GAUSSIAN_STEP_3BIT",
    "GAUSSIAN_STEP_4BIT",
    "LATTICE_BITS",
    "LATTICE_SIGMA",
    "all_digits",
    "check_lattice_bits",
    "code_dtype",
    "decode_grouped",
    "initial_lattice",
    "lattice_sigma",
    "make_grid",
    "nearest_codeword",
    "random_orthogonal",
    "refit_lattice",
    "round_to_lattice",
]
