"""Tests for lowrank_jax.optim.loda (LoDA subspaces, GAO, recalibration, merge)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax.optim.loda import (
    CovStat,
    decompose,
    feature_stats,
    gao,
    loda_delta,
    merge,
    old_principal_mask,
    projection_energy,
    recalibrate,
    update_memory,
)

D = 16


def _task_inputs(seed, n=200, shared_dims=(0, 1, 2, 3), own_dims=(4, 5, 6)):
    """Correlated tasks: a strong shared block plus a task-specific block plus weak noise."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(np.random.default_rng(0).normal(size=(D, D)))[0]
    coeff = np.zeros((n, D))
    coeff[:, list(shared_dims)] = rng.normal(scale=3.0, size=(n, len(shared_dims)))
    coeff[:, list(own_dims)] = rng.normal(scale=2.0, size=(n, len(own_dims)))
    coeff += rng.normal(scale=0.05, size=coeff.shape)
    return jnp.asarray(coeff @ basis.T, jnp.float32)


def _randn(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


_DECOMPOSE = jax.jit(decompose, static_argnames=("k_g", "k_i", "old_energy"))
_RECAL = jax.jit(recalibrate, static_argnames=("lam", "ridge"))
_CACHE = {}


def _setup():
    if not _CACHE:
        x_old = _task_inputs(1, own_dims=(4, 5, 6))
        x_new = _task_inputs(2, own_dims=(7, 8, 9))
        _CACHE["data"] = (x_old, x_new, feature_stats(x_old).c, feature_stats(x_new).c)
    return _CACHE["data"]


def _sub():
    if "sub" not in _CACHE:
        _, _, c_old, c_new = _setup()
        _CACHE["sub"] = _DECOMPOSE(c_new, c_old, k_g=3, k_i=4)
    return _CACHE["sub"]


def test_subspaces_orthonormal_and_orthogonal():
    _, _, c_old, _ = _setup()
    sub = _sub()  # decompose under jax.jit
    assert bool(jnp.all(sub.valid_g)) and bool(jnp.all(sub.valid_i))
    np.testing.assert_allclose(sub.a_g @ sub.a_g.T, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(sub.a_i @ sub.a_i.T, np.eye(4), atol=1e-5)
    np.testing.assert_allclose(sub.a_g @ sub.a_i.T, np.zeros((3, 4)), atol=1e-5)
    v, mask = old_principal_mask(c_old, 0.97)
    p_old = (v * mask) @ v.T
    # span(A_Gᵀ) ⊆ range P_old and A_I P_old = 0
    np.testing.assert_allclose(sub.a_g @ p_old, sub.a_g, atol=1e-5)
    np.testing.assert_allclose(sub.a_i @ p_old, np.zeros_like(sub.a_i), atol=1e-5)
    # the isolated subspace sees at most the old energy left outside P_old
    assert float(sub.energy_old_i) <= 0.03 + 1e-6
    # and it catches most of the new task's own energy (3 own dims of 3² vs 4 shared of 3²)
    assert float(sub.energy_new_i) > 0.25


def test_first_task_has_empty_general_subspace():
    _, _, _, c_new = _setup()
    sub = _DECOMPOSE(c_new, jnp.zeros_like(c_new), k_g=3, k_i=4)
    assert int(sub.old_rank) == 0
    assert not bool(jnp.any(sub.valid_g))
    np.testing.assert_array_equal(np.asarray(sub.a_g), np.zeros((3, D)))
    # with P_old = 0, U_I is the plain top-4 eigenbasis of C_new
    w = np.linalg.eigvalsh(np.asarray(c_new, np.float64))[::-1]
    np.testing.assert_allclose(float(sub.energy_new_i), w[:4].sum() / w.sum(), rtol=1e-4)


@pytest.mark.parametrize("old_energy", [0.5, 0.9, 0.97, 0.999])
def test_energy_split_respects_threshold(old_energy):
    _, _, c_old, _ = _setup()
    v, mask = old_principal_mask(c_old, old_energy)
    k = int(mask.sum())
    assert np.all(np.asarray(mask)[:k])  # a prefix of the descending eigenbasis
    w = np.linalg.eigvalsh(np.asarray(c_old, np.float64))[::-1]
    captured = np.cumsum(w) / w.sum()
    assert captured[k - 1] >= old_energy - 1e-5  # enough energy kept
    if k > 1:
        assert captured[k - 2] < old_energy  # and the smallest such set
    e = projection_energy(v[:, :k], c_old)
    np.testing.assert_allclose(float(e), captured[k - 1], rtol=1e-4)


def test_energy_optimality_ky_fan():
    _, _, c_old, c_new = _setup()
    sub = _sub()
    v, mask = old_principal_mask(c_old, 0.97)
    v_in, v_out = np.asarray(v)[:, np.asarray(mask)], np.asarray(v)[:, ~np.asarray(mask)]
    c = np.asarray(c_new, np.float64)
    energy = lambda q: np.trace(q.T @ c @ q) / np.trace(c)  # noqa: E731
    rng = np.random.default_rng(0)
    for _ in range(100):
        q_i = v_out @ np.linalg.qr(rng.normal(size=(v_out.shape[1], 4)))[0]
        q_g = v_in @ np.linalg.qr(rng.normal(size=(v_in.shape[1], 3)))[0]
        assert float(sub.energy_new_i) >= energy(q_i) - 1e-5
        assert float(sub.energy_new_g) >= energy(q_g) - 1e-5


def test_isolation_bound_on_old_outputs():
    x_old, _, c_old, c_new = _setup()
    sub = _sub()
    b_i = _randn(0, 4, 5)
    change = jnp.linalg.norm(x_old @ sub.a_i.T @ b_i)
    bound = np.sqrt(0.03 * float(jnp.trace(c_old))) * float(jnp.linalg.norm(b_i, 2))
    assert float(change) <= bound


def _recal_reference(b_g, a_g, x_new, x_old, lam, ridge):
    """Stacked least squares solved independently with NumPy (float64)."""
    b_g, a_g, x_new, x_old = (np.asarray(t, np.float64) for t in (b_g, a_g, x_new, x_old))
    z_new, z_old = x_new @ a_g.T, x_old @ a_g.T
    rho = ridge * np.trace(z_new.T @ z_new + lam * z_old.T @ z_old)
    lhs = np.concatenate([z_new, np.sqrt(lam) * z_old, np.sqrt(rho) * np.eye(a_g.shape[0])])
    rhs = np.concatenate([z_new @ b_g, np.zeros((len(z_old), b_g.shape[1])),
                          np.zeros((a_g.shape[0], b_g.shape[1]))])
    return np.linalg.lstsq(lhs, rhs, rcond=None)[0]


@pytest.mark.parametrize("lam", [0.3, 1.0, 5.0])
def test_recalibrate_matches_stacked_lstsq(lam):
    x_old, x_new, c_old, c_new = _setup()
    sub = _sub()
    b_g = _randn(1, 3, 6)
    got = _RECAL(b_g, sub.a_g, c_new, c_old, lam=lam, ridge=1e-6)
    want = _recal_reference(b_g, sub.a_g, x_new, x_old, lam, 1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-3, atol=2e-4)
    # shared directions are shrunk, never amplified, in the K_new metric
    assert np.linalg.norm(want) <= np.linalg.norm(np.asarray(b_g)) * 1.001


def test_recalibrate_limits():
    _, _, c_old, c_new = _setup()
    sub = _sub()
    b_g = _randn(2, 3, 6)
    np.testing.assert_allclose(_RECAL(b_g, sub.a_g, c_new, c_old, lam=0.0), b_g, rtol=1e-4,
                               atol=1e-5)
    # K_old → ∞ along the first shared direction zeroes that row (in A_G's coordinates)
    u0 = sub.a_g[0]
    huge = c_old + 1e9 * jnp.outer(u0, u0)
    out = _RECAL(b_g, sub.a_g, c_new, huge, lam=1.0, ridge=0.0)
    assert float(jnp.max(jnp.abs(out[0]))) < 1e-3 * float(jnp.max(jnp.abs(b_g)))


def test_gao_alignment_and_step():
    x_old, x_new, c_old, c_new = _setup()
    sub = _sub()
    w = _randn(3, D, 5) / 4
    y = _randn(4, x_new.shape[0], 5)
    loss_w = lambda w_: jnp.mean((x_new @ w_ - y) ** 2)  # noqa: E731
    a = jnp.concatenate([sub.a_g, sub.a_i])
    b0 = jnp.zeros((7, 5))
    grad_b = jax.jit(jax.grad(lambda b: loss_w(w + a.T @ b)))(b0)
    grad_w = jax.jit(jax.grad(loss_w))(w)
    np.testing.assert_allclose(grad_b, a @ grad_w, rtol=1e-4, atol=1e-5)
    lr = 1e-2
    tx = gao(lr, momentum=0.9, max_norm=None)
    upd, _ = tx.update(grad_b, tx.init(b0))
    b1 = optax.apply_updates(b0, upd)
    np.testing.assert_allclose(a.T @ b1, -lr * a.T @ a @ grad_w, rtol=1e-4, atol=1e-6)


def test_merge_exact_and_memory_counts():
    x_old, x_new, c_old, c_new = _setup()
    sub = _sub()
    w, b_g, b_i = _randn(5, D, 5), _randn(6, 3, 5), _randn(7, 4, 5)
    adapter = x_new @ w + 0.5 * ((x_new @ sub.a_g.T) @ b_g + (x_new @ sub.a_i.T) @ b_i)
    merged = x_new @ jax.jit(merge)(w, sub.a_g, b_g, sub.a_i, b_i, 0.5)
    np.testing.assert_allclose(merged, adapter, rtol=1e-5, atol=1e-4)
    mem = update_memory(CovStat(jnp.zeros((D, D)), jnp.int32(0)), feature_stats(x_old))
    mem = update_memory(mem, feature_stats(x_new))
    assert int(mem.n) == x_old.shape[0] + x_new.shape[0]
    np.testing.assert_allclose(mem.c, c_old + c_new, rtol=1e-6)
    masked = feature_stats(x_new, jnp.arange(x_new.shape[0]) < 50)
    assert int(masked.n) == 50
    np.testing.assert_allclose(masked.c, x_new[:50].T @ x_new[:50], rtol=1e-5, atol=1e-3)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_input_raises():
    _, _, c_old, c_new = _setup()
    with pytest.raises(ValueError, match="k_g"):
        decompose(c_new, c_old, k_g=D + 1, k_i=2)
    with pytest.raises(ValueError, match="c_old shape"):
        decompose(c_new, c_old[:4, :4], k_g=2, k_i=2)
    with pytest.raises(ValueError, match="old_energy"):
        old_principal_mask(c_old, 1.5)
    with pytest.raises(ValueError, match="a_g"):
        recalibrate(jnp.zeros((2, 3)), jnp.zeros((2, D + 1)), c_new, c_old)
    with pytest.raises(ValueError, match="momentum"):
        gao(0.1, momentum=1.0)
    with pytest.raises(ValueError, match="rank mismatch"):
        loda_delta(jnp.zeros((2, D)), jnp.zeros((3, 4)), jnp.zeros((2, D)), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="mask shape"):
        feature_stats(jnp.zeros((4, D)), jnp.ones((5,), bool))
