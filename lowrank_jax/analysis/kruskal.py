"""Kruskal rank (k-rank): the largest k such that *every* k columns are linearly independent.

``M [p, n]`` holds ``n`` column vectors in ``R^p`` (for a LoRA factor ``A [d_in, r]`` in our
``[in, out]`` layout pass ``A.T``, i.e. p = r, n = d_in). ``krank ≤ rank ≤ min(p, n)`` and
``spark = krank + 1``. Exact computation is NP-hard (Tillmann & Pfetsch 2014), so the exact routine
is host-side and budgeted; bounds and random probing cover large matrices. Shared by the spectral
analysis and LoKRA specs.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


def _normalised_columns(matrix) -> np.ndarray:
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"matrix must be 2-D [p, n] (n columns in R^p), got shape {m.shape}.")
    norms = np.linalg.norm(m, axis=0)
    safe = np.where(norms > 0, norms, 1.0)
    return m / safe, norms


def _subsets_independent(cols: np.ndarray, subsets: np.ndarray, rtol: float) -> np.ndarray:
    """For each subset (rows of ``subsets``), whether σ_min of the normalised columns > rtol."""
    blocks = cols[:, subsets].transpose(1, 0, 2)  # [num, p, k]
    s = np.linalg.svd(blocks, compute_uv=False)
    return s[:, -1] > rtol


def kruskal_rank_exact(
    matrix: Float[Array, "p n"], *, rtol: float = 1e-6, max_subsets: int = 2**20
) -> int:
    """Exact Kruskal rank by exhaustive search over column subsets (host-side).

    Normalise columns; for k = 1, 2, … test every k-subset for ``σ_k(M_S) > rtol`` and stop at the
    first k with a dependent subset (k > p is automatically dependent). A zero column gives 0.

    Args:
      matrix: ``[p, n]``, columns are the vectors.
      rtol: threshold on the smallest singular value of a normalised subset.
      max_subsets: budget on the number of subsets tested; exceeding it raises.

    Returns:
      The Kruskal rank (int).

    Example::

        >>> import numpy as np
        >>> kruskal_rank_exact(np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]))
        2
        >>> kruskal_rank_exact(np.array([[1.0, 1.0], [0.0, 0.0]]))
        1

    References:
      Kruskal 1977; Sidiropoulos & Bro, "On the uniqueness of multilinear decomposition of N-way
      arrays", J. Chemometrics 2000.
    """
    cols, norms = _normalised_columns(matrix)
    p, n = cols.shape
    if n == 0 or np.any(norms == 0):
        return 0
    top = min(p, n)
    needed = sum(math.comb(n, k) for k in range(2, top + 1))
    used = 0
    for k in range(2, top + 1):
        count = math.comb(n, k)
        if used + count > max_subsets:
            raise ValueError(
                f"kruskal_rank_exact needs {needed} subsets for matrix shape {cols.shape} but "
                f"max_subsets={max_subsets}; raise max_subsets or use kruskal_rank_bounds / "
                "numerical_krank."
            )
        used += count
        combos = itertools.combinations(range(n), k)
        while True:
            chunk = np.array(list(itertools.islice(combos, 4096)), dtype=np.int64)
            if chunk.size == 0:
                break
            if not np.all(_subsets_independent(cols, chunk, rtol)):
                return k - 1
    return top


def numerical_krank(
    key: PRNGKeyArray, matrix: Float[Array, "p n"], *, rtol: float = 1e-6, trials: int = 256
) -> int:
    """Kruskal rank estimated by random probing of k-subsets: a certified *upper* bound.

    For each k up to ``rank``, draw ``trials`` random k-subsets; the first k at which a dependent
    subset is found certifies ``krank ≤ k − 1``. If none is found, returns the numerical rank.

    Example::

        >>> import jax, numpy as np
        >>> m = np.random.default_rng(0).normal(size=(4, 6))
        >>> numerical_krank(jax.random.key(0), m)
        4
    """
    cols, norms = _normalised_columns(matrix)
    p, n = cols.shape
    if n == 0 or np.any(norms == 0):
        return 0
    s = np.linalg.svd(cols, compute_uv=False)
    rank = int(np.sum(s > rtol * max(s[0], 1e-300)))
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    for k in range(2, rank + 1):
        subsets = np.stack([rng.choice(n, size=k, replace=False) for _ in range(trials)])
        if not np.all(_subsets_independent(cols, subsets, rtol)):
            return k - 1
    return rank


def coherence(matrix: Float[Array, "p n"]) -> float:
    """Mutual coherence ``μ = max_{i≠j} |m̂_iᵀ m̂_j|`` of the normalised columns."""
    cols, _ = _normalised_columns(matrix)
    gram = np.abs(cols.T @ cols)
    np.fill_diagonal(gram, 0.0)
    return float(gram.max()) if gram.size > 1 else 0.0


def kruskal_rank_bounds(matrix: Float[Array, "p n"], *, rtol: float = 1e-6) -> tuple[int, int]:
    """Cheap bounds ``min(⌈1/μ⌉, rank) ≤ krank ≤ rank`` (Donoho–Elad coherence bound).

    ``μ = 0`` (orthogonal columns) gives ``krank = rank``.

    Example::

        >>> import numpy as np
        >>> kruskal_rank_bounds(np.eye(3))
        (3, 3)

    References:
      Donoho & Elad, "Optimally sparse representation ... via ℓ1 minimization", PNAS 2003.
    """
    cols, norms = _normalised_columns(matrix)
    if cols.shape[1] == 0 or np.any(norms == 0):
        return 0, 0
    s = np.linalg.svd(cols, compute_uv=False)
    rank = int(np.sum(s > rtol * s[0]))
    mu = coherence(cols)
    if mu <= 1e-12:
        return rank, rank
    lower = min(math.ceil(1.0 / mu - 1e-9), rank)
    return lower, rank


def khatri_rao(a: Float[Array, "p n"], b: Float[Array, "q n"]) -> Float[Array, "pq n"]:
    """Column-wise Kronecker product ``A ⊙ B`` with ``(A ⊙ B)[:, j] = a_j ⊗ b_j``.

    ``krank(A ⊙ B) ≥ min(krank A + krank B − 1, n)`` (Sidiropoulos & Bro 2000).

    Example::

        >>> import jax.numpy as jnp
        >>> khatri_rao(jnp.ones((2, 3)), jnp.ones((4, 3))).shape
        (8, 3)
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a {a.shape} and b {b.shape} must be 2-D with the same column count.")
    return jnp.einsum("pn,qn->pqn", a, b).reshape(a.shape[0] * b.shape[0], a.shape[1])


__all__ = ["coherence", "khatri_rao", "kruskal_rank_bounds", "kruskal_rank_exact",
           "numerical_krank"]
