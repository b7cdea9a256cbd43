"""SVD backends for analysis: exact, Gram-streaming (tall matrices) and randomized (top-k).

The randomized SVD is the shared one of ``lowrank_jax/optim/linalg.py`` (design.md), re-exported
with the analysis spec's argument order ``(key, matrix, rank, *, oversample, power_iterations)``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


def _check_matrix(matrix, name: str = "matrix") -> None:
    if getattr(matrix, "ndim", None) != 2:
        raise ValueError(
            f"{name} must be 2-D, got shape {getattr(matrix, 'shape', None)}; reshape stacked "
            "kernels explicitly to (prod(in_axes), out) first."
        )


def svd_exact(
    matrix: Float[Array, "m n"],
) -> tuple[Float[Array, "m k"], Float[Array, " k"], Float[Array, "k n"]]:
    """Thin SVD ``W = U diag(s) Vᵀ`` with ``s`` descending (``k = min(m, n)``).

    Args:
      matrix: a 2-D array.

    Returns:
      ``(U [m,k], s [k], Vt [k,n])``.

    Example::

        >>> import jax.numpy as jnp
        >>> _, s, _ = svd_exact(jnp.diag(jnp.array([1.0, 3.0])))
        >>> s.tolist()
        [3.0, 1.0]
    """
    _check_matrix(matrix)
    return jnp.linalg.svd(matrix, full_matrices=False)


def singular_values(matrix: Float[Array, "m n"]) -> Float[Array, " k"]:
    """Singular values only (descending), ``k = min(m, n)``."""
    _check_matrix(matrix)
    return jnp.linalg.svd(matrix, compute_uv=False)


def singular_values_gram(
    row_blocks: Iterable[Float[Array, "b n"]], *, dtype=np.float64
) -> Float[np.ndarray, " n"]:
    """Singular values of a tall matrix streamed as row blocks, via its Gram matrix (host-side).

    .. math:: G = \\sum_{blocks} B^T B,\\qquad \\sigma = \\sqrt{\\max(\\mathrm{eig}(G), 0)}

    Loses relative accuracy for ``σ_i < sqrt(ε)·σ_1``; fine for effective/stable rank, not for
    counts of tiny singular values. Workspace ``n × n`` whatever the number of rows.

    Args:
      row_blocks: iterable of ``[b_i, n]`` arrays (the rows of the matrix, in any order).
      dtype: accumulation dtype (float64 default, computed with numpy).

    Returns:
      ``s [n]`` descending (numpy array).

    Example::

        >>> import numpy as np
        >>> w = np.random.default_rng(0).normal(size=(100, 4))
        >>> s = singular_values_gram([w[:50], w[50:]])
        >>> bool(np.allclose(s, np.linalg.svd(w, compute_uv=False)))
        True
    """
    gram = None
    for block in row_blocks:
        b = np.asarray(block, dtype=dtype)
        if b.ndim != 2:
            raise ValueError(f"row_blocks: each block must be 2-D, got shape {b.shape}.")
        gram = b.T @ b if gram is None else gram + b.T @ b
    if gram is None:
        raise ValueError("row_blocks is empty; pass at least one [rows, n] block.")
    eig = np.linalg.eigvalsh(gram)[::-1]
    return np.sqrt(np.maximum(eig, 0.0))


@functools.cache
def _jitted_shared_rsvd():
    from lowrank_jax.optim.linalg import randomized_svd as shared  # lazy: optim is heavier

    return jax.jit(shared, static_argnames=("rank", "oversample", "power_iters"))


def randomized_svd(
    key: PRNGKeyArray,
    matrix: Float[Array, "m n"],
    rank: int,
    *,
    oversample: int = 10,
    power_iterations: int = 2,
) -> tuple[Float[Array, "m rank"], Float[Array, " rank"], Float[Array, "rank n"]]:
    """Top-``rank`` SVD by the Halko–Martinsson–Tropp randomized range finder.

    .. math::
        Y = A\\Omega,\\ \\Omega\\sim N(0,1)^{n\\times(k+p)};\\quad
        Y \\leftarrow A(A^T \\mathrm{qr}(Y))\\ (q\\ \\text{times});\\quad
        Q = \\mathrm{qr}(Y),\\ B = Q^T A = \\hat U s V^T,\\ U = Q\\hat U

    Only for top-k quantities (spectral norm, top subspaces, overlaps), not full-spectrum metrics.

    Args:
      key: PRNG key for the test matrix Ω.
      matrix: ``A [m, n]``.
      rank: number of components ``k`` (``1 ≤ k ≤ min(m, n)``).
      oversample: extra columns ``p`` (clipped so ``k + p ≤ min(m, n)``).
      power_iterations: ``q`` subspace iterations, re-orthonormalised each time.

    Returns:
      ``(U [m,k], s [k] descending, Vt [k,n])``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> a = jax.random.normal(jax.random.key(0), (50, 3)) @ jax.random.normal(
        ...     jax.random.key(1), (3, 40))
        >>> _, s, _ = randomized_svd(jax.random.key(2), a, 3)
        >>> bool(jnp.allclose(s, jnp.linalg.svd(a, compute_uv=False)[:3], rtol=1e-4))
        True

    References:
      Halko, Martinsson, Tropp, `Finding structure with randomness
      <https://arxiv.org/abs/0909.4061>`_, SIAM Review 2011.
    """
    _check_matrix(matrix)
    m, n = matrix.shape
    if not isinstance(rank, (int, np.integer)) or not 1 <= rank <= min(m, n):
        raise ValueError(f"rank={rank} must be an int in [1, min(m, n)={min(m, n)}].")
    return _jitted_shared_rsvd()(
        matrix, int(rank), oversample=oversample, power_iters=power_iterations, key=key
    )


__all__ = ["randomized_svd", "singular_values", "singular_values_gram", "svd_exact"]
