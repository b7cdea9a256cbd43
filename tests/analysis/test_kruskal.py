"""Kruskal rank on hand-built matrices, bounds and Khatri–Rao (spectral_analysis spec §6)."""

import jax
import numpy as np
import pytest

from lowrank_jax.analysis import (
    khatri_rao,
    kruskal_rank_bounds,
    kruskal_rank_exact,
    numerical_krank,
)


def test_generic_wide_matrix_has_krank_p_not_n():
    m = np.random.default_rng(0).normal(size=(6, 8))
    assert kruskal_rank_exact(m) == 6


def test_duplicate_column_gives_one():
    m = np.random.default_rng(1).normal(size=(4, 5))
    m[:, 3] = -2.0 * m[:, 1]
    assert kruskal_rank_exact(m) == 1


def test_one_three_column_dependency_gives_two():
    m = np.random.default_rng(2).normal(size=(5, 6))
    m[:, 4] = m[:, 0] + m[:, 2]
    assert kruskal_rank_exact(m) == 2
    assert np.linalg.matrix_rank(m) == 5  # rank stays high: krank ≤ rank, often much lower


def test_zero_column_and_identity():
    assert kruskal_rank_exact(np.eye(4)) == 4
    z = np.eye(3)
    z[:, 1] = 0
    assert kruskal_rank_exact(z) == 0


@pytest.mark.parametrize("seed", range(4))
def test_bounds_bracket_the_exact_value(seed):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(4, 7))
    if seed % 2:
        m[:, 5] = m[:, 1] + m[:, 2]
    lower, upper = kruskal_rank_bounds(m)
    exact = kruskal_rank_exact(m)
    assert lower <= exact <= upper
    probe = numerical_krank(jax.random.key(seed), m, trials=512)
    assert exact <= probe <= upper  # random probing is a certified upper bound


def test_orthogonal_columns_give_tight_bounds():
    assert kruskal_rank_bounds(np.eye(5)[:, :3]) == (3, 3)


@pytest.mark.parametrize("seed", range(3))
def test_khatri_rao_bound_holds(seed):
    rng = np.random.default_rng(10 + seed)
    n = 6
    a = rng.normal(size=(3, n))
    a[:, 4] = a[:, 0]  # krank(A) = 1
    b = rng.normal(size=(3, n))
    b[:, 5] = b[:, 1] + b[:, 2]  # krank(B) = 2
    ka, kb = kruskal_rank_exact(a), kruskal_rank_exact(b)
    kab = kruskal_rank_exact(np.asarray(khatri_rao(a, b)))
    assert (ka, kb) == (1, 2)
    assert kab >= min(ka + kb - 1, n)
    col = np.asarray(khatri_rao(a, b))[:, 3]
    np.testing.assert_allclose(col, np.kron(a[:, 3], b[:, 3]), rtol=1e-6)


def test_exact_search_refuses_beyond_budget():
    m = np.random.default_rng(3).normal(size=(10, 30))
    with pytest.raises(ValueError, match="max_subsets"):
        kruskal_rank_exact(m, max_subsets=1000)
