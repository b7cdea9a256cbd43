"""Kruskal rank (k-rank): the largest k such that *every* k columns are linearly independent.

``M [p, n]`` holds ``n`` column vectors in ``R^p`` (for a LoRA factor ``A [d_in, r]`` in our
``[in, out]`` layout pass ``A.T``, i.e. p = r, n = d_in). ``krank ≤ rank ≤ min(p, n)`` and
``spark = krank + 1``. Exact computation is NP-hard (Tillmann & Pfetsch 2014), so the exact routine
is host-side and budgeted; bounds and random probing cover large matrices. The package's one Kruskal
module: the spectral analysis and LoKRA (:mod:`lowrank_jax.nn.lokra`, which trains with
:func:`kruskal_penalty`) both use it.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


def _normalised_columns(matrix) -> tuple[np.ndarray, np.ndarray]:
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
    matrix: Float[Array | np.ndarray, "p n"], *, rtol: float = 1e-6, max_subsets: int = 2**20
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
    key: PRNGKeyArray,
    matrix: Float[Array | np.ndarray, "p n"],
    *,
    rtol: float = 1e-6,
    trials: int = 256,
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


def _unit_columns(m, eps):
    norms = jnp.sqrt(jnp.sum(m * m, axis=0, keepdims=True) + eps * eps)
    return m / norms


def coherence(matrix: Float[Array | np.ndarray, "p n"], eps: float = 1e-12) -> Float[Array, ""]:
    """Mutual coherence ``μ(M) = max_{i≠j} |cos(m_i, m_j)|`` of the columns (``k(M) ≥ 1/μ``).

    Differentiable (``eps`` guards zero columns); 0 for a single column.

    Example::

        >>> import jax.numpy as jnp
        >>> float(coherence(jnp.eye(3)))
        0.0
        >>> round(float(coherence(jnp.array([[1.0, 1.0], [0.0, 1.0]]))), 4)
        0.7071
    """
    m = jnp.asarray(matrix, jnp.float32)
    if m.ndim != 2:
        raise ValueError(f"coherence: matrix has shape {m.shape}; pass a [p, n] matrix.")
    unit = _unit_columns(m, eps)
    cos = jnp.abs(unit.T @ unit)
    return jnp.max(jnp.where(jnp.eye(m.shape[1], dtype=bool), 0.0, cos), initial=0.0)


PenaltyKind = Literal["frame", "coherence"]


def kruskal_penalty(
    m: Float[Array | np.ndarray, "p n"],
    *,
    kind: PenaltyKind = "frame",
    eps: float = 1e-6,
    tau: float = 20.0,
    skip_below: float = 1e-3,
) -> Float[Array, ""]:
    """Differentiable surrogate pushing up the Kruskal rank of the columns of ``m`` (DERIVED).

    .. math::

        \\hat M = M / \\|m_j\\|,\\qquad
        \\text{frame: } \\frac{\\|\\hat M \\hat M^\\top\\|_F^2}{n^2} - \\frac1p \\ge 0,\\qquad
        \\text{coherence: } \\tfrac1\\tau \\log \\sum_{i<j} e^{\\tau \\cos^2(m_i, m_j)}

    The frame potential is zero iff the normalised columns form a tight frame and costs
    ``O(n p²)`` (no ``n × n`` Gram); the coherence form is a smooth max of ``cos²`` and costs
    ``O(n² p)``. Column norms have an ``eps`` guard (finite gradients at a zero column); a
    matrix whose largest entry is below ``skip_below`` (e.g. ``B = 0`` at init) gets 0.

    Args:
        m: ``[p, n]`` channel codes (columns = channels), e.g. ``lora_aᵀ`` or ``lora_b``.
        kind: ``"frame"`` or ``"coherence"``.
        eps: column-norm guard.
        tau: sharpness of the coherence smooth max.
        skip_below: below this max-abs value the penalty is 0.

    Returns:
        A scalar.

    Example::

        >>> import jax.numpy as jnp
        >>> float(kruskal_penalty(jnp.concatenate([jnp.eye(2), jnp.eye(2)], axis=1)))
        0.0
        >>> float(kruskal_penalty(jnp.array([[1.0, 1.0], [0.0, 0.0]])))  # duplicated columns
        0.5
    """
    if m.ndim != 2:
        raise ValueError(f"kruskal_penalty: m has shape {m.shape}; pass a [p, n] matrix.")
    if kind not in ("frame", "coherence"):
        raise ValueError(f"kruskal_penalty: kind={kind!r}; use 'frame' or 'coherence'.")
    m = m.astype(jnp.float32)
    p, n = m.shape
    unit = _unit_columns(m, eps)
    if kind == "frame":
        gram = unit @ unit.T
        value = jnp.sum(gram * gram) / (n * n) - 1.0 / p
    else:
        cos2 = (unit.T @ unit) ** 2
        upper = jnp.triu(jnp.ones((n, n), bool), k=1)
        value = jax.nn.logsumexp(jnp.where(upper, tau * cos2, -jnp.inf)) / tau
    return jnp.where(jnp.max(jnp.abs(m)) > skip_below, value, 0.0)


def kruskal_rank_bounds(
    matrix: Float[Array | np.ndarray, "p n"], *, rtol: float = 1e-6
) -> tuple[int, int]:
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
    mu = float(coherence(cols))
    if mu <= 1e-12:
        return rank, rank
    lower = min(math.ceil(1.0 / mu - 1e-9), rank)
    return lower, rank


def khatri_rao(a: Float[Array | np.ndarray, "p n"], b: Float[Array, "q n"]) -> Float[Array, "pq n"]:
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


__all__ = ["PenaltyKind", "coherence", "khatri_rao", "kruskal_penalty", "kruskal_rank_bounds",
           "kruskal_rank_exact", "numerical_krank"]
