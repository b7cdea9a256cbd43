"""Known answers for the rank metrics and the SVD backends (spectral_analysis spec §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.analysis import (
    alpha_req,
    anisotropy,
    effective_rank,
    effective_rank_of,
    energy_rank,
    isotropy_partition,
    numerical_rank,
    randomized_svd,
    rankme,
    singular_values_gram,
    stable_rank,
    stable_rank_of,
)


@pytest.mark.parametrize("n", [1, 5, 32])
def test_effective_rank_of_identity_is_n(n):
    assert float(effective_rank_of(jnp.eye(n))) == pytest.approx(n, rel=1e-5)


def test_effective_rank_of_rank_one_is_one():
    rng = np.random.default_rng(0)
    w = np.outer(rng.normal(size=20), rng.normal(size=12))
    assert float(effective_rank_of(jnp.asarray(w))) == pytest.approx(1.0, abs=1e-3)


def test_effective_rank_bounds_and_known_value():
    s = jnp.array([3.0, 1.0, 0.0])
    p = np.array([0.75, 0.25])
    assert float(effective_rank(s)) == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-6)
    s = jnp.asarray(np.random.default_rng(1).random(40))
    assert 1.0 <= float(effective_rank(s)) <= 40.0


def test_stable_and_numerical_rank():
    s = jnp.array([2.0, 1.0, 1e-4, 0.0])
    assert float(stable_rank(s)) == pytest.approx((4 + 1 + 1e-8) / 4, rel=1e-6)
    assert int(numerical_rank(s)) == 2
    assert int(numerical_rank(s, rtol=1e-10)) == 3
    w = jnp.asarray(np.random.default_rng(2).normal(size=(30, 10)))
    sv = jnp.linalg.svd(w, compute_uv=False)
    assert float(stable_rank_of(w)) <= int(numerical_rank(sv)) + 10 * 1e-5 + 1e-5


def test_energy_rank_counts_components():
    s = jnp.array([3.0, 2.0, 1.0, 0.5])  # energies 9, 4, 1, 0.25 of 14.25
    assert int(energy_rank(s, 0.6)) == 1
    assert int(energy_rank(s, 0.9)) == 2
    assert int(energy_rank(s, 0.99)) == 4
    with pytest.raises(ValueError, match="energy"):
        energy_rank(s, 1.5)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_metrics_reject_matrices_where_spectra_are_expected():
    with pytest.raises(ValueError, match="1-D"):
        effective_rank(jnp.eye(3))


def test_rankme_of_isotropic_and_collapsed_embeddings():
    z = jax.random.normal(jax.random.key(0), (3000, 8))
    assert 7.5 < float(rankme(z)) <= 8.0 + 1e-3
    collapsed = jnp.outer(jax.random.normal(jax.random.key(1), (500,)), jnp.ones(8))
    assert float(rankme(collapsed)) < 1.1


def test_alpha_req_recovers_power_law_decay():
    d = 64
    scales = jnp.arange(1, d + 1, dtype=jnp.float32) ** -1.0  # λ_i ∝ i^{-2} ⇒ α = 2
    z = jax.random.normal(jax.random.key(3), (6000, d)) * scales
    assert float(alpha_req(z)) == pytest.approx(2.0, abs=0.25)
    with pytest.raises(ValueError, match="i_min"):
        alpha_req(z, i_min=40, i_max=10)


def test_anisotropy_known_answers_and_pairwise_definition():
    same = jnp.tile(jnp.array([[1.0, 2.0, -1.0]]), (5, 1))
    assert float(anisotropy(same)) == pytest.approx(1.0, abs=1e-5)
    assert float(anisotropy(jnp.eye(6))) == pytest.approx(0.0, abs=1e-6)
    h = np.random.default_rng(4).normal(size=(9, 4)) + 0.5
    u = h / np.linalg.norm(h, axis=1, keepdims=True)
    cos = u @ u.T
    pairwise = (cos.sum() - 9) / (9 * 8)
    assert float(anisotropy(jnp.asarray(h))) == pytest.approx(pairwise, abs=1e-5)


def test_isotropy_partition_is_one_for_symmetric_cloud_and_small_when_shifted():
    cloud = jnp.concatenate([jnp.eye(4), -jnp.eye(4)])
    assert float(isotropy_partition(cloud)) == pytest.approx(1.0, abs=1e-5)
    shifted = cloud + 3.0
    assert float(isotropy_partition(shifted)) < 0.1


def test_randomized_svd_matches_exact_on_low_rank_matrix():
    k = 5
    key_a, key_b, key_c = jax.random.split(jax.random.key(5), 3)
    u, _ = jnp.linalg.qr(jax.random.normal(key_a, (120, k)))
    v, _ = jnp.linalg.qr(jax.random.normal(key_b, (80, k)))
    s_true = jnp.array([10.0, 7.0, 5.0, 3.0, 2.0])
    noise = 1e-3 * jax.random.normal(key_c, (120, 80)) / jnp.sqrt(120.0)
    a = (u * s_true) @ v.T + noise  # gap σ_5 / σ_6 ≫ 10
    ur, sr, vtr = randomized_svd(a, k, key=jax.random.key(6))
    se = jnp.linalg.svd(a, compute_uv=False)[:k]
    np.testing.assert_allclose(np.asarray(sr), np.asarray(se), rtol=1e-3)
    # subspace agreement: principal angles ~ 0
    cos = jnp.linalg.svd(ur.T @ u, compute_uv=False)
    assert float(jnp.min(cos)) > 1 - 1e-5
    assert ur.shape == (120, k) and vtr.shape == (k, 80)
    with pytest.raises(ValueError, match="rank"):
        randomized_svd(a, 0, key=jax.random.key(0))


def test_gram_backend_equals_exact_svd():
    w = np.random.default_rng(7).normal(size=(5000, 64))
    blocks = [w[i:i + 700] for i in range(0, 5000, 700)]
    np.testing.assert_allclose(
        singular_values_gram(blocks), np.linalg.svd(w, compute_uv=False), rtol=1e-8
    )
