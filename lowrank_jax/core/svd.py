"""SVD backends for analysis: exact and Gram-streaming (tall matrices).

The randomized (top-k) SVD is the package's one :func:`lowrank_jax.core.linalg.randomized_svd`
(``randomized_svd(matrix, rank, *, oversample, power_iters, key)``), re-exported by
:mod:`lowrank_jax.analysis`.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


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


__all__ = ["singular_values", "singular_values_gram", "svd_exact"]
