"""Weight spectra: empirical spectral density, power-law and Marchenko–Pastur fits, and the
checkpoint-to-checkpoint comparisons of Diffract (spectral share, singular-vector overlap).

Conventions: ``W [m, n]``, ``M = min(m, n)``, ``N = max(m, n)``, ``Q = N/M``; singular values are
**descending** (Diffract's toolkit stores them ascending — convert when comparing).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from lowrank_jax.core.svd import singular_values
from lowrank_jax.core.rank import (
    effective_rank,
    energy_rank,
    numerical_rank,
    stable_rank,
)


def esd(s: Float[Array, " k"], n_max: int) -> Float[Array, " k"]:
    """Eigenvalues of the (scaled) correlation matrix, ``λ_i = σ_i² / N`` (Diffract convention).

    Args:
      s: singular values.
      n_max: ``N = max(m, n)`` of the matrix.

    Example::

        >>> import jax.numpy as jnp
        >>> esd(jnp.array([2.0]), 4).tolist()
        [1.0]
    """
    return jnp.square(s) / n_max


def powerlaw_alpha(eigenvalues, *, min_tail: int = 50) -> dict:
    """Power-law exponent of the ESD tail by maximum likelihood with a KS-chosen ``x_min``.

    .. math:: \\hat\\alpha = 1 + n_{tail} / \\sum_{\\lambda_i \\ge x_{min}} \\ln(\\lambda_i/x_{min})

    ``x_min`` runs over the eigenvalues and minimises the Kolmogorov–Smirnov distance between the
    empirical tail and the fitted Pareto law, requiring ``n_tail ≥ min_tail`` (host-side, numpy).

    Args:
      eigenvalues: ESD eigenvalues (any order).
      min_tail: smallest tail size considered; fewer ⇒ NaN result.

    Returns:
      ``{"alpha", "xmin", "ks", "n_tail"}`` (NaN alpha when the spectrum is too short).

    Example::

        >>> import numpy as np
        >>> x = (1 - np.random.default_rng(0).random(2000)) ** (-1 / 1.5)  # alpha = 2.5
        >>> bool(abs(powerlaw_alpha(x)["alpha"] - 2.5) < 0.2)
        True

    References:
      Clauset, Shalizi, Newman, `Power-law distributions in empirical data
      <https://arxiv.org/abs/0706.1062>`_, 2009; Martin & Mahoney (WeightWatcher), 2021.
    """
    lam = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    lam = lam[lam > 0]
    nan = {"alpha": float("nan"), "xmin": float("nan"), "ks": float("nan"), "n_tail": 0}
    if lam.size < min_tail:
        return nan
    best = None
    # candidate cut-offs: every eigenvalue leaving at least ``min_tail`` points in the tail
    for start in range(0, lam.size - min_tail + 1):
        xmin = lam[start]
        tail = lam[start:]
        logs = np.log(tail / xmin)
        denom = logs.sum()
        if denom <= 0:
            continue
        alpha = 1.0 + tail.size / denom
        empirical = np.arange(tail.size) / tail.size
        fitted = 1.0 - (tail / xmin) ** (1.0 - alpha)
        ks = float(np.max(np.abs(empirical - fitted)))
        if best is None or ks < best["ks"]:
            best = {"alpha": float(alpha), "xmin": float(xmin), "ks": ks, "n_tail": int(tail.size)}
    return best or nan


def mp_edge(std: float, shape: tuple[int, int]) -> tuple[float, float]:
    """Marchenko–Pastur bulk edges ``λ_± = s²(1 ± Q^{-1/2})²`` for i.i.d. entries of std ``s``.

    Matches :func:`esd`'s scaling ``λ = σ²/N``.

    Example::

        >>> mp_edge(1.0, (100, 100))
        (0.0, 4.0)
    """
    m, n = shape
    q = max(m, n) / min(m, n)
    root = q ** -0.5
    return float(std**2 * (1 - root) ** 2), float(std**2 * (1 + root) ** 2)


def mp_spike_count(matrix: Float[Array, "m n"], s: Float[Array, " k"] | None = None) -> int:
    """Number of ESD eigenvalues above the Marchenko–Pastur upper edge (the "spikes").

    The edge uses ``s`` = std of the entries; a random Gaussian matrix has ≈ 0 spikes, learned
    structure shows as spikes.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> w = jax.random.normal(jax.random.key(0), (400, 200))
        >>> mp_spike_count(w) <= 1
        True
    """
    if s is None:
        s = singular_values(matrix)
    m, n = matrix.shape
    lam = np.asarray(esd(s, max(m, n)))
    _, upper = mp_edge(float(jnp.std(matrix)), (m, n))
    return int(np.sum(lam > upper))


def spectral_share(w0: Float[Array, "m n"], w1: Float[Array, "m n"]) -> Float[Array, ""]:
    """Fraction of an update explained by the change of singular *values* (DERIVED, Mirsky).

    .. math:: S = \\|\\sigma(W_1) - \\sigma(W_0)\\|_2 / \\|W_1 - W_0\\|_F \\in [0, 1]

    Mirsky's inequality guarantees ``S ≤ 1``. ``S ≈ 0``: the update rotates singular vectors;
    ``S = 1``: it only rescales them (e.g. ``W1 = c·W0``). Diffract's claim ⇔ S small.

    Example::

        >>> import jax.numpy as jnp
        >>> w = jnp.array([[2.0, 0.0], [0.0, 1.0]])
        >>> float(spectral_share(w, 3 * w))
        1.0

    References:
      Diffract (ICML 2026), https://openreview.net/forum?id=XBUHoiAGDE
    """
    if w0.shape != w1.shape or w0.ndim != 2:
        raise ValueError(f"w0 {w0.shape} and w1 {w1.shape} must be 2-D of the same shape.")
    num = jnp.linalg.norm(singular_values(w1) - singular_values(w0))
    den = jnp.linalg.norm(w1 - w0)
    return jnp.where(den > 0, num / jnp.maximum(den, jnp.finfo(den.dtype).tiny), 0.0)


def singular_overlap(
    u0: Float[Array, "d r"], u1: Float[Array, "d r"], *, k: int | None = None
) -> Float[Array, "k k"]:
    """Absolute overlap ``O = |U0[:, :k]ᵀ U1[:, :k]|`` of two singular bases (sign-invariant).

    Noise floor for unrelated bases: ``O_ii ≈ sqrt(2/(π d))``, ``max_j O_ij ≈ sqrt(2 ln k / d)``.

    Example::

        >>> import jax.numpy as jnp
        >>> singular_overlap(jnp.eye(3), -jnp.eye(3)).tolist()[0]
        [1.0, 0.0, 0.0]
    """
    if u0.ndim != 2 or u0.shape[0] != u1.shape[0]:
        raise ValueError(f"u0 {u0.shape} and u1 {u1.shape} must be [d, r] with the same d.")
    k = min(u0.shape[1], u1.shape[1]) if k is None else k
    return jnp.abs(u0[:, :k].T @ u1[:, :k])


def principal_angles(u0: Float[Array, "d k"], u1: Float[Array, "d k"]) -> Float[Array, " k"]:
    """Principal angles (radians, ascending) between the column spans of two orthonormal bases.

    ``cos θ = svd(U0ᵀ U1)``; invariant to order, sign and any rotation inside each subspace.

    Example::

        >>> import jax.numpy as jnp
        >>> principal_angles(jnp.eye(3)[:, :1], jnp.eye(3)[:, 1:2]).tolist()
        [1.5707963705062866]
    """
    cos = jnp.clip(singular_values(u0.T @ u1), 0.0, 1.0)
    return jnp.arccos(cos)


def overlap_summary(overlap: Float[Array, "k k"]) -> dict:
    """Means of the diagonal agreement ``O_ii`` and best match ``max_j O_ij``, plus noise floors.

    The noise floors assume unrelated bases in ``d`` dims, which this function cannot know; they
    are filled in by :func:`compare_matrices`.
    """
    return {
        "diag_mean": float(jnp.mean(jnp.diag(overlap))),
        "best_match_mean": float(jnp.mean(jnp.max(overlap, axis=1))),
    }


def matrix_summary(matrix: Float[Array, "m n"], *, s=None) -> dict:
    """Every per-matrix metric as floats: norms, ranks, ESD power law, MP spikes.

    Example::

        >>> import jax.numpy as jnp
        >>> matrix_summary(jnp.eye(4))["effective_rank"]
        4.0
    """
    if s is None:
        s = singular_values(matrix)
    m, n = matrix.shape
    s = jnp.asarray(s)
    lam = np.asarray(esd(s, max(m, n)))
    fit = powerlaw_alpha(lam)
    return {
        "shape": [int(m), int(n)],
        "frobenius_norm": float(jnp.sqrt(jnp.sum(jnp.square(s)))),
        "spectral_norm": float(jnp.max(s)),
        "effective_rank": float(effective_rank(s)),
        "stable_rank": float(stable_rank(s)),
        "numerical_rank": int(numerical_rank(s)),
        "energy_rank_90": int(energy_rank(s, 0.9)),
        "energy_rank_99": int(energy_rank(s, 0.99)),
        "powerlaw_alpha": fit["alpha"],
        "powerlaw_ks": fit["ks"],
        "mp_spikes": mp_spike_count(matrix, s) if matrix is not None else None,
    }


def compare_matrices(w0: Float[Array, "m n"], w1: Float[Array, "m n"], *, k: int = 8) -> dict:
    """Diffract's pairwise fields for one matrix: spectral share, relative update/spectrum change,
    top-k singular-vector overlaps (left and right) with their noise floors, principal angles.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> w = jax.random.normal(jax.random.key(0), (16, 8))
        >>> compare_matrices(w, w)["spectral_share"]
        0.0
    """
    if w0.shape != w1.shape:
        raise ValueError(f"shapes differ: {w0.shape} vs {w1.shape}; compare the same parameter.")
    # host-side (numpy, float64): returns plain floats, avoids per-shape XLA compiles
    a0, a1 = np.asarray(w0, np.float64), np.asarray(w1, np.float64)
    u0, s0, vt0 = np.linalg.svd(a0, full_matrices=False)
    u1, s1, vt1 = np.linalg.svd(a1, full_matrices=False)
    k = min(k, s0.shape[0])
    m, n = a0.shape
    left = np.abs(u0[:, :k].T @ u1[:, :k])
    right = np.abs(vt0[:k] @ vt1[:k].T)
    delta = np.linalg.norm(a1 - a0)
    cos_left = np.clip(np.linalg.svd(u0[:, :k].T @ u1[:, :k], compute_uv=False), 0, 1)
    cos_right = np.clip(np.linalg.svd(vt0[:k] @ vt1[:k].T, compute_uv=False), 0, 1)
    return {
        "spectral_share": float(np.linalg.norm(s1 - s0) / delta) if delta > 0 else 0.0,
        "relative_update": float(delta / np.linalg.norm(a0)),
        "relative_spectrum_change": float(np.linalg.norm(s1 - s0) / np.linalg.norm(s0)),
        "left_diag_overlap": float(np.mean(np.diag(left))),
        "left_best_overlap": float(np.mean(np.max(left, axis=1))),
        "right_diag_overlap": float(np.mean(np.diag(right))),
        "right_best_overlap": float(np.mean(np.max(right, axis=1))),
        "left_noise_floor": math.sqrt(2 / (math.pi * m)),
        "right_noise_floor": math.sqrt(2 / (math.pi * n)),
        "left_max_angle_deg": float(np.degrees(np.arccos(np.min(cos_left)))),
        "right_max_angle_deg": float(np.degrees(np.arccos(np.min(cos_right)))),
        "top_k": int(k),
    }


__all__ = [
    "compare_matrices", "esd", "matrix_summary", "mp_edge", "mp_spike_count", "overlap_summary",
    "powerlaw_alpha", "principal_angles", "singular_overlap", "spectral_share",
]
