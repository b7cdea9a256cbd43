"""CKA invariances and the unbiased HSIC (spectral_analysis spec §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.analysis import (
    cka_matrix,
    hsic_biased,
    hsic_unbiased,
    linear_cka,
    minibatch_cka,
    rbf_cka,
)


def _data(seed=0, n=60, p=8, q=5):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p))
    y = x[:, :q] @ rng.normal(size=(q, q)) + 0.5 * rng.normal(size=(n, q))
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def test_cka_of_identical_inputs_is_one():
    x, _ = _data()
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-5)
    assert float(rbf_cka(x, x)) == pytest.approx(1.0, abs=1e-5)


def test_cka_invariant_to_orthogonal_transform_isotropic_scaling_translation():
    x, y = _data(1)
    q, _ = np.linalg.qr(np.random.default_rng(2).normal(size=(8, 8)))
    ref = float(linear_cka(x, y))
    assert float(linear_cka(x @ jnp.asarray(q, jnp.float32), y)) == pytest.approx(ref, abs=1e-5)
    assert float(linear_cka(3.7 * x, y)) == pytest.approx(ref, abs=1e-5)
    assert float(linear_cka(x + 5.0, y)) == pytest.approx(ref, abs=1e-4)
    ref_rbf = float(rbf_cka(x, y))
    assert float(rbf_cka(x @ jnp.asarray(q, jnp.float32), y)) == pytest.approx(ref_rbf, abs=1e-5)
    assert float(rbf_cka(2.5 * x, y)) == pytest.approx(ref_rbf, abs=1e-5)


def test_cka_not_invariant_to_generic_linear_map():
    x, _ = _data(3)
    m = jnp.asarray(np.diag([10.0, 5, 1, 1, 0.2, 0.1, 0.1, 0.05]), jnp.float32)
    assert float(linear_cka(x, x @ m)) < 0.9


def test_cka_symmetric_and_in_unit_interval():
    for seed in range(4):
        x, y = _data(seed)
        a, b = float(linear_cka(x, y)), float(linear_cka(y, x))
        assert a == pytest.approx(b, abs=1e-6)
        assert 0.0 <= a <= 1.0 + 1e-6


def test_gram_form_equals_feature_form():
    x, y = _data(4, n=30, p=6, q=4)
    wide = jnp.concatenate([x, jnp.zeros((30, 40))], axis=1)  # p > n → Gram form
    assert float(linear_cka(wide, y)) == pytest.approx(float(linear_cka(x, y)), abs=1e-5)


def test_rbf_cka_tends_to_linear_cka_for_wide_kernels():
    x, y = _data(5)
    assert float(rbf_cka(x, y, sigma_frac=300.0)) == pytest.approx(float(linear_cka(x, y)),
                                                                   abs=2e-3)


def test_unbiased_hsic_of_independent_inputs_averages_zero():
    n, draws = 50, 300
    rng = np.random.default_rng(0)
    x = rng.normal(size=(draws, n, 10)).astype(np.float32)
    y = rng.normal(size=(draws, n, 10)).astype(np.float32)
    kx = jnp.asarray(np.einsum("bip,bjp->bij", x, x))
    ly = jnp.asarray(np.einsum("bip,bjp->bij", y, y))
    both = jax.jit(jax.vmap(lambda k, l: (hsic_unbiased(k, l), hsic_biased(k, l))))
    u, b = both(kx, ly)
    u, b = np.asarray(u), np.asarray(b)
    se = u.std() / np.sqrt(draws)
    assert abs(u.mean()) < 3 * se
    assert b.mean() > 10 * b.std() / np.sqrt(draws)  # the biased estimator is clearly positive


def test_minibatch_cka_of_identical_batches_is_one_and_needs_n_ge_4():
    x, _ = _data(6)
    assert float(minibatch_cka([(x[:30], x[:30]), (x[30:], x[30:])])) == pytest.approx(1.0,
                                                                                      abs=1e-5)
    with pytest.raises(ValueError, match="n >= 4"):
        hsic_unbiased(jnp.eye(3), jnp.eye(3))


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_cka_matrix_diagonal_and_bad_shapes():
    x, y = _data(7)
    m = np.asarray(cka_matrix([x, y, 2 * x]))
    np.testing.assert_allclose(np.diag(m), 1.0, atol=1e-5)
    assert m[0, 2] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="same n"):
        linear_cka(x, y[:10])


def test_layer_distance_means_on_a_banded_matrix():
    from lowrank_jax.analysis.cka import layer_distance_means

    n = 8
    m = np.array([[0.9 ** abs(i - j) for j in range(n)] for i in range(n)])
    adjacent, distant = layer_distance_means(m, far=5)
    assert adjacent == pytest.approx(0.9)
    pairs = [abs(i - j) for i in range(n) for j in range(n) if abs(i - j) >= 5]
    assert distant == pytest.approx(np.mean([0.9 ** d for d in pairs]))
