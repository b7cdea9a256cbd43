"""Centered kernel alignment (CKA) and the HSIC estimators behind it.

``X [n, p1]`` and ``Y [n, p2]`` are two representations of the same ``n`` inputs (rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def _check_pair(x, y) -> None:
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x {x.shape} and y {y.shape} must be [n, p] with the same n (rows = the same inputs)."
        )


def _center_gram(k):
    n = k.shape[0]
    h = jnp.eye(n, dtype=k.dtype) - 1.0 / n
    return h @ k @ h


def hsic_biased(k: Float[Array, "n n"], l: Float[Array, "n n"]) -> Float[Array, ""]:
    """Biased HSIC ``tr(K H L H) / (n−1)²`` with ``H = I − 11ᵀ/n``.

    Example::

        >>> import jax.numpy as jnp
        >>> float(hsic_biased(jnp.eye(4), jnp.zeros((4, 4))))
        0.0
    """
    n = k.shape[0]
    return jnp.sum(_center_gram(k) * l) / (n - 1) ** 2


def hsic_unbiased(k: Float[Array, "n n"], l: Float[Array, "n n"]) -> Float[Array, ""]:
    """Unbiased HSIC of Song et al. (2012), ``n ≥ 4``; diagonals of K and L are zeroed.

    .. math::
        \\mathrm{HSIC}_u = \\frac{1}{n(n-3)}\\Big[\\mathrm{tr}(\\tilde K\\tilde L)
        + \\frac{1^T\\tilde K 1\\, 1^T\\tilde L 1}{(n-1)(n-2)}
        - \\frac{2}{n-2} 1^T \\tilde K\\tilde L 1\\Big]

    Averages to 0 for independent inputs (the biased estimator is positive).

    Example::

        >>> import jax.numpy as jnp
        >>> float(hsic_unbiased(jnp.ones((5, 5)), jnp.ones((5, 5))))
        0.0

    References:
      Song et al., "Feature selection via dependence maximization", JMLR 2012;
      Nguyen, Raghu, Kornblith, `Do wide and deep networks learn the same things?
      <https://arxiv.org/abs/2010.15327>`_, ICLR 2021.
    """
    n = k.shape[0]
    if n < 4:
        raise ValueError(f"hsic_unbiased needs n >= 4 samples, got n={n}.")
    k = k * (1.0 - jnp.eye(n, dtype=k.dtype))
    l = l * (1.0 - jnp.eye(n, dtype=l.dtype))
    k1, l1 = jnp.sum(k, axis=1), jnp.sum(l, axis=1)
    term = jnp.sum(k * l) + jnp.sum(k1) * jnp.sum(l1) / ((n - 1) * (n - 2))
    term = term - 2.0 * jnp.dot(k1, l1) / (n - 2)
    return term / (n * (n - 3))


def kernel_cka(
    k: Float[Array, "n n"], l: Float[Array, "n n"], *, unbiased: bool = False
) -> Float[Array, ""]:
    """CKA of two Gram matrices: ``HSIC(K,L) / sqrt(HSIC(K,K) HSIC(L,L))``.

    Example::

        >>> import jax.numpy as jnp
        >>> k = jnp.array([[2.0, 1, 0, 0], [1, 2, 0, 0], [0, 0, 1, 0], [0, 0, 0, 3]])
        >>> round(float(kernel_cka(k, k)), 6)
        1.0
    """
    hsic = hsic_unbiased if unbiased else hsic_biased
    kl, kk, ll = hsic(k, l), hsic(k, k), hsic(l, l)
    return kl / jnp.sqrt(jnp.maximum(kk * ll, jnp.finfo(kk.dtype).tiny))


def linear_cka(
    x: Float[Array, "n p1"], y: Float[Array, "n p2"], *, unbiased: bool = False
) -> Float[Array, ""]:
    """Linear CKA ``‖YᵀX‖_F² / (‖XᵀX‖_F ‖YᵀY‖_F)`` on column-centred X, Y.

    Invariant to orthogonal transforms, isotropic scaling and translation; not to a generic
    invertible linear map. Uses the feature form when ``p ≤ n`` and the n×n Gram form otherwise
    (or whenever ``unbiased=True``).

    Args:
      x: ``[n, p1]`` representation.
      y: ``[n, p2]`` representation of the same inputs.
      unbiased: use the debiased HSIC (needed when n is small relative to the widths).

    Returns:
      Scalar in [0, 1] (the unbiased version can dip slightly below 0).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (20, 5))
        >>> round(float(linear_cka(x, 3 * x + 1)), 5)
        1.0

    References:
      Kornblith et al., `Similarity of neural network representations revisited
      <https://arxiv.org/abs/1905.00414>`_, ICML 2019.
    """
    _check_pair(x, y)
    x = x - jnp.mean(x, axis=0)
    y = y - jnp.mean(y, axis=0)
    n = x.shape[0]
    if unbiased or max(x.shape[1], y.shape[1]) > n:
        return kernel_cka(x @ x.T, y @ y.T, unbiased=unbiased)
    cross = jnp.sum(jnp.square(y.T @ x))
    return cross / (jnp.linalg.norm(x.T @ x) * jnp.linalg.norm(y.T @ y))


def rbf_gram(x: Float[Array, "n p"], *, sigma_frac: float = 0.5) -> Float[Array, "n n"]:
    """RBF Gram ``exp(−‖x_i−x_j‖²/(2σ²))`` with ``σ = sigma_frac · median_{i≠j} ‖x_i−x_j‖``."""
    sq = jnp.sum(x * x, axis=1)
    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0)
    n = x.shape[0]
    off = d2[~jnp.eye(n, dtype=bool)]
    sigma = sigma_frac * jnp.median(jnp.sqrt(off))
    return jnp.exp(-d2 / (2 * jnp.maximum(sigma, 1e-30) ** 2))


def rbf_cka(
    x: Float[Array, "n p1"],
    y: Float[Array, "n p2"],
    *,
    sigma_frac: float = 0.5,
    unbiased: bool = False,
) -> Float[Array, ""]:
    """CKA with RBF kernels (bandwidth a fraction of the median pairwise distance).

    Tends to linear CKA as ``sigma_frac → ∞``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (12, 3))
        >>> round(float(rbf_cka(x, x)), 5)
        1.0
    """
    _check_pair(x, y)
    if sigma_frac <= 0:
        raise ValueError(f"sigma_frac={sigma_frac} must be > 0.")
    return kernel_cka(
        rbf_gram(x, sigma_frac=sigma_frac), rbf_gram(y, sigma_frac=sigma_frac), unbiased=unbiased
    )


def minibatch_cka(batches) -> Float[Array, ""]:
    """Minibatch linear CKA (Nguyen et al. 2021): average unbiased HSICs over batches, then ratio.

    Args:
      batches: iterable of ``(x [b, p1], y [b, p2])`` pairs, ``b ≥ 4``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (40, 3))
        >>> round(float(minibatch_cka([(x[:20], x[:20]), (x[20:], x[20:])])), 5)
        1.0
    """
    kl = kk = ll = 0.0
    count = 0
    for x, y in batches:
        _check_pair(x, y)
        k, l = x @ x.T, y @ y.T
        kl = kl + hsic_unbiased(k, l)
        kk = kk + hsic_unbiased(k, k)
        ll = ll + hsic_unbiased(l, l)
        count += 1
    if count == 0:
        raise ValueError("batches is empty; pass at least one (x, y) pair.")
    return kl / jnp.sqrt(kk * ll)


def cka_matrix(reps: list, *, unbiased: bool = False) -> Float[Array, "L L"]:
    """Pairwise linear CKA between a list of representations of the same inputs (e.g. layers).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (10, 3))
        >>> cka_matrix([x, 2 * x]).shape
        (2, 2)
    """
    grams = []
    for r in reps:
        r = r - jnp.mean(r, axis=0)
        grams.append(r @ r.T)
    size = len(grams)
    hsic = hsic_unbiased if unbiased else hsic_biased
    self_h = [hsic(g, g) for g in grams]
    out = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j in range(i, size):
            v = hsic(grams[i], grams[j]) / jnp.sqrt(self_h[i] * self_h[j])
            out[i][j] = out[j][i] = v
    return jnp.array(out)


def layer_distance_means(matrix, *, far: int = 5) -> tuple[float, float]:
    """Mean similarity of adjacent layers and of layers at least ``far`` apart in a ``[L, L]``
    similarity matrix (e.g. :func:`cka_matrix`): ``(mean_i M[i, i+1], mean_{|i-j|>=far} M[i, j])``.

    Cross-layer redundancy (what cross-layer KV compression builds on) shows as a high first
    value; the second says how far it reaches.

    Example::

        >>> import numpy as np
        >>> m = np.array([[1.0, 0.8, 0.2], [0.8, 1.0, 0.6], [0.2, 0.6, 1.0]])
        >>> [round(v, 6) for v in layer_distance_means(m, far=2)]
        [0.7, 0.2]
    """
    m = np.asarray(matrix)
    n = len(m)
    adjacent = float(np.mean(np.diag(m, 1)))
    distant = float(np.mean([m[i, j] for i in range(n) for j in range(n) if abs(i - j) >= far]))
    return adjacent, distant


__all__ = [
    "cka_matrix", "hsic_biased", "hsic_unbiased", "kernel_cka", "layer_distance_means",
    "linear_cka", "minibatch_cka", "rbf_cka", "rbf_gram",
]
