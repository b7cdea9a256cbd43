"""Rank-like descriptors of a spectrum and geometric metrics of a set of vectors.

All metrics taking ``s`` expect singular values (any order; they are sorted where it matters) and
have a ``*_of(W)`` wrapper taking the matrix. They are *descriptive diagnostics*: the unembedding
study (arXiv:2602.20433) finds none of them a reliable predictor of downstream quality.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.scipy.special import logsumexp
from jaxtyping import Array, Float

from lowrank_jax.core.svd import singular_values


def _check_spectrum(s, name: str = "s") -> None:
    if getattr(s, "ndim", None) != 1:
        raise ValueError(
            f"{name} must be a 1-D array of singular values, got shape "
            f"{getattr(s, 'shape', None)}; "
            "use the *_of(matrix) wrapper to pass a matrix."
        )


def effective_rank(s: Float[Array, " k"], *, eps: float = 0.0) -> Float[Array, ""]:
    """Roy–Vetterli effective rank: the exponential of the entropy of the normalised spectrum.

    .. math:: p_i = \\sigma_i / \\sum_j \\sigma_j,\\qquad
              \\mathrm{erank} = \\exp(-\\sum_i p_i \\ln p_i) \\in [1, \\mathrm{rank}]

    ``0·log 0 := 0``. This is the one meaning of ``effective_rank`` in lowrank_jax (an
    energy-threshold count is :func:`energy_rank`).

    Args:
      s: singular values ``[k]`` (non-negative).
      eps: added to ``p_i`` inside the log (Diffract's toolkit uses 1e-16; RankMe 1e-7).

    Returns:
      Scalar effective rank.

    Example::

        >>> import jax.numpy as jnp
        >>> float(effective_rank(jnp.ones(5)))
        5.0

    References:
      Roy & Vetterli, "The effective rank: a measure of effective dimensionality", EUSIPCO 2007.
    """
    _check_spectrum(s)
    s = jnp.abs(s)
    p = s / jnp.maximum(jnp.sum(s), jnp.finfo(s.dtype).tiny)
    plogp = jnp.where(p > 0, p * jnp.log(p + eps), 0.0)
    return jnp.exp(-jnp.sum(plogp))


def stable_rank(s: Float[Array, " k"]) -> Float[Array, ""]:
    """Stable rank ``‖W‖_F² / ‖W‖_2² = Σσ_i² / σ_1²`` ∈ [1, rank].

    Example::

        >>> import jax.numpy as jnp
        >>> float(stable_rank(jnp.array([2.0, 2.0, 0.0])))
        2.0
    """
    _check_spectrum(s)
    s2 = jnp.square(s)
    return jnp.sum(s2) / jnp.maximum(jnp.max(s2), jnp.finfo(s2.dtype).tiny)


def numerical_rank(s: Float[Array, " k"], *, rtol: float = 1e-5) -> Array:
    """Numerical rank ``#{σ_i² > rtol·σ_1²}`` (Diffract's default ``rtol = 1e-5``).

    Example::

        >>> import jax.numpy as jnp
        >>> int(numerical_rank(jnp.array([1.0, 0.5, 1e-4])))
        2
    """
    _check_spectrum(s)
    s2 = jnp.square(s)
    return jnp.sum(s2 > rtol * jnp.max(s2))


def energy_rank(s: Float[Array, " k"], energy: float = 0.9) -> Array:
    """Smallest count of leading components holding a fraction ``energy`` of ``Σσ²``.

    .. math:: \\min\\{k : \\sum_{i\\le k}\\sigma_i^2 \\ge \\mathrm{energy}\\sum_i\\sigma_i^2\\}

    Args:
      s: singular values (any order; sorted descending here).
      energy: threshold in (0, 1].

    Returns:
      an int32 count; 0 when every value is 0.

    Example::

        >>> import jax.numpy as jnp
        >>> int(energy_rank(jnp.array([3.0, 1.0, 0.1]), 0.85))
        1
    """
    _check_spectrum(s)
    if not 0.0 < float(energy) <= 1.0:
        raise ValueError(f"energy={energy} must lie in (0, 1].")
    s2 = jnp.sort(jnp.square(s.astype(jnp.float32)))[::-1]
    total = jnp.sum(s2)
    cumulative = jnp.cumsum(s2) / jnp.where(total > 0, total, 1.0)
    count = jnp.minimum(jnp.sum(cumulative < energy * (1 - 1e-12)) + 1, s.shape[0])
    return jnp.where(total > 0, count, 0).astype(jnp.int32)  # a zero spectrum has rank 0


def rankme(embeddings: Float[Array, "n d"], *, eps: float = 1e-7) -> Float[Array, ""]:
    """RankMe: the entropy effective rank of a representation matrix with ``p_k = σ_k/‖σ‖₁ + ε``.

    Use ``n ≫ d`` samples. Representations (not weights) in, scalar out.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> z = jax.random.normal(jax.random.key(0), (2000, 4))
        >>> bool(3.8 < float(rankme(z)) <= 4.0)
        True

    References:
      Garrido et al., `RankMe <https://arxiv.org/abs/2210.02885>`_, ICML 2023.
    """
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [n_samples, d], got shape {embeddings.shape}.")
    s = singular_values(embeddings)
    p = s / jnp.sum(s) + eps
    return jnp.exp(-jnp.sum(p * jnp.log(p)))


def alpha_req(
    embeddings: Float[Array, "n d"], *, i_min: int = 2, i_max: int | None = None
) -> Float[Array, ""]:
    """α-ReQ: power-law decay rate of the covariance eigenspectrum of centred representations.

    Least squares ``log λ_i ≈ c − α log i`` over ``i ∈ [i_min, i_max]`` (1-based, DERIVED
    defaults ``i_min = 2``, ``i_max = min(n, d) // 2``). Larger α ⇒ faster decay.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> z = jax.random.normal(jax.random.key(0), (4000, 64)) * (jnp.arange(1, 65) ** -0.5)
        >>> bool(abs(float(alpha_req(z)) - 1.0) < 0.2)
        True

    References:
      Agrawal et al., "α-ReQ: Assessing representation quality by measuring eigenspectrum decay",
      NeurIPS 2022.
    """
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [n_samples, d], got shape {embeddings.shape}.")
    n, d = embeddings.shape
    top = min(n, d)
    i_max = top // 2 if i_max is None else i_max
    if not 1 <= i_min < i_max <= top:
        raise ValueError(
            f"need 1 <= i_min < i_max <= min(n, d)={top}; got i_min={i_min}, i_max={i_max}."
        )
    z = embeddings - jnp.mean(embeddings, axis=0)
    lam = jnp.square(singular_values(z)) / max(n - 1, 1)
    idx = jnp.arange(i_min, i_max + 1)
    x = jnp.log(idx.astype(lam.dtype))
    y = jnp.log(jnp.maximum(lam[idx - 1], jnp.finfo(lam.dtype).tiny))
    xc = x - jnp.mean(x)
    slope = jnp.sum(xc * (y - jnp.mean(y))) / jnp.sum(xc * xc)
    return -slope


def anisotropy(vectors: Float[Array, "n d"]) -> Float[Array, ""]:
    """Mean pairwise cosine similarity in O(n·d), without the pairwise matrix.

    .. math:: A = (\\|\\sum_i \\hat h_i\\|^2 - n) / (n(n-1)),\\quad \\hat h = h/\\|h\\|

    1 for identical vectors, 0 for an orthonormal set.

    Example::

        >>> import jax.numpy as jnp
        >>> float(anisotropy(jnp.eye(3)))
        0.0
    """
    if vectors.ndim != 2 or vectors.shape[0] < 2:
        raise ValueError(f"vectors must be [n >= 2, d], got shape {vectors.shape}.")
    n = vectors.shape[0]
    unit = vectors / jnp.maximum(jnp.linalg.norm(vectors, axis=1, keepdims=True), 1e-30)
    total = jnp.sum(unit, axis=0)
    return (jnp.sum(total * total) - n) / (float(n) * (n - 1))  # float: n² overflows int32


def isotropy_partition(vectors: Float[Array, "n d"]) -> Float[Array, ""]:
    """Mu & Viswanath isotropy ``min_c Z(c) / max_c Z(c)``, ``Z(c) = Σ_i exp(cᵀh_i)``.

    ``c`` ranges over the eigenvectors of ``HᵀH`` (1 = isotropic). Computed with a log-sum-exp.

    Example::

        >>> import jax.numpy as jnp
        >>> float(isotropy_partition(jnp.zeros((4, 3))))
        1.0

    References:
      Mu & Viswanath, `All-but-the-Top <https://arxiv.org/abs/1702.01417>`_, ICLR 2018.
    """
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be [n, d], got shape {vectors.shape}.")
    _, eigvecs = jnp.linalg.eigh(vectors.T @ vectors)
    log_z = logsumexp(vectors @ eigvecs, axis=0)
    return jnp.exp(jnp.min(log_z) - jnp.max(log_z))


def effective_rank_of(matrix: Float[Array, "m n"], *, eps: float = 0.0) -> Float[Array, ""]:
    """:func:`effective_rank` of a matrix's singular values."""
    return effective_rank(singular_values(matrix), eps=eps)


def stable_rank_of(matrix: Float[Array, "m n"]) -> Float[Array, ""]:
    """:func:`stable_rank` of a matrix."""
    return stable_rank(singular_values(matrix))


def numerical_rank_of(matrix: Float[Array, "m n"], *, rtol: float = 1e-5) -> Array:
    """:func:`numerical_rank` of a matrix."""
    return numerical_rank(singular_values(matrix), rtol=rtol)


def energy_rank_of(matrix: Float[Array, "m n"], energy: float = 0.9) -> Array:
    """:func:`energy_rank` of a matrix."""
    return energy_rank(singular_values(matrix), energy)


__all__ = [
    "alpha_req", "anisotropy", "effective_rank", "effective_rank_of", "energy_rank",
    "energy_rank_of", "isotropy_partition", "numerical_rank", "numerical_rank_of", "rankme",
    "stable_rank", "stable_rank_of",
]
