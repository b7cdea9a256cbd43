"""SALAAD: proximal operators, penalty gradient, RPCA sanity, controllers, HPA budgets."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.core.rank import energy_rank
from lowrank_jax.optim import (
    SalaadConfig,
    apply_surrogate,
    find_salaad_state,
    hpa_allocate,
    hpa_materialize,
    salaad,
    salaad_admm_step,
    salaad_init,
    salaad_penalty,
    salaad_stats,
    scale_by_salaad,
)
from lowrank_jax.optim.salaad import soft_threshold, svt
from lowrank_jax.optim.salaad_deploy import surrogate_counts


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_proximal_operators_are_the_prox():
    z = jnp.asarray(_rng().standard_normal((5, 4)), jnp.float32)
    t = 0.7
    low, shrunk = svt(z, t)
    sigma = jnp.linalg.svd(z, compute_uv=False)
    np.testing.assert_allclose(shrunk, jnp.maximum(sigma - t, 0.0), atol=1e-6)
    nuclear = lambda x: t * jnp.sum(jnp.linalg.svd(x, compute_uv=False)) + 0.5 * jnp.sum(
        (x - z) ** 2)
    # brute force: subgradient descent on the prox objective from a random start
    x = jnp.zeros_like(z)
    grad = jax.jit(jax.grad(nuclear))
    for i in range(3000):
        x = x - 0.5 / (1 + i) ** 0.5 * grad(x)
    assert float(nuclear(low)) <= float(nuclear(x)) + 1e-4
    np.testing.assert_allclose(low, x, atol=2e-2)
    soft = soft_threshold(z, t)
    l1 = lambda x: t * jnp.sum(jnp.abs(x)) + 0.5 * jnp.sum((x - z) ** 2)
    for k in range(5):
        other = soft + 0.05 * jax.random.normal(jax.random.key(k), z.shape)
        assert float(l1(soft)) <= float(l1(other))
    np.testing.assert_allclose(soft, jnp.sign(z) * jnp.maximum(jnp.abs(z) - t, 0), atol=0)
    assert int(energy_rank(jnp.array([3.0, 1.0, 0.0]), 0.9)) == 1
    assert int(energy_rank(jnp.zeros(3), 0.999)) == 0


def test_penalty_gradient_and_no_gradient_into_surrogate():
    params = {"w": jnp.asarray(_rng(1).standard_normal((6, 4)), jnp.float32),
              "b": jnp.ones((4,))}
    config = SalaadConfig(rho=0.3)
    state = salaad_init(params, config)
    state = salaad_admm_step(params, state, config)
    state = salaad_admm_step(jax.tree.map(lambda x: 1.1 * x, params), state, config)
    g = jax.grad(salaad_penalty)(params, state)
    l, s, y = state.low_rank["w"], state.sparse["w"], state.dual["w"]
    np.testing.assert_allclose(g["w"], 0.3 * (params["w"] - l - s + y / 0.3), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(g["b"], 0.0)
    g_state = jax.grad(lambda st: salaad_penalty(params, st), allow_int=True)(state)
    for leaf in (g_state.low_rank["w"], g_state.sparse["w"], g_state.dual["w"]):
        np.testing.assert_allclose(leaf, 0.0)


def _rpca_problem(m=40, n=40, rank=2, frac=0.05, seed=0):
    rng = _rng(seed)
    l0 = rng.standard_normal((m, rank)) @ rng.standard_normal((rank, n)) / np.sqrt(rank)
    s0 = np.zeros((m, n))
    idx = rng.choice(m * n, int(frac * m * n), replace=False)
    s0.flat[idx] = rng.choice([-5.0, 5.0], idx.size)
    return jnp.asarray(l0, jnp.float32), jnp.asarray(s0, jnp.float32)


def _run_admm(params, state, config, updates, *, dual=True):
    step = jax.jit(lambda st: salaad_admm_step(params, st, config))
    history = []
    for _ in range(updates):
        state = step(state)
        if not dual:  # a monotone plant: rank(τ_L) and density(τ_S) with no dual drift
            state = state._replace(dual=jax.tree.map(jnp.zeros_like, state.dual))
        history.append((float(state.rank_rate["w"]), float(state.density["w"])))
    return state, history


def test_admm_solves_robust_pca_with_fixed_thresholds():
    l0, s0 = _rpca_problem()
    x = l0 + s0
    mu = x.size / (4.0 * float(jnp.sum(jnp.abs(x))))  # classical RPCA choices
    lam = 1.0 / np.sqrt(max(x.shape))
    config = SalaadConfig(rho=mu, kI_alpha=0.0, kD_alpha=0.0, kI_beta=0.0, kD_beta=0.0)
    params = {"w": x}
    state = salaad_init(params, config)
    state = state._replace(alpha={"w": jnp.asarray(1.0)}, beta={"w": jnp.asarray(lam)})
    state, _ = _run_admm(params, state, config, 300)
    l, s = state.low_rank["w"], state.sparse["w"]
    assert float(jnp.linalg.norm(x - l - s) / jnp.linalg.norm(x)) < 1e-3
    assert float(jnp.linalg.norm(l - l0) / jnp.linalg.norm(l0)) < 1e-2
    assert float(jnp.linalg.norm(s - s0) / jnp.linalg.norm(s0)) < 1e-2
    assert float(state.alpha["w"]) == 1.0 and float(state.beta["w"]) == pytest.approx(lam)


def test_controllers_steer_rank_and_density_to_targets():
    rng = _rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((32, 32)))
    v, _ = np.linalg.qr(rng.standard_normal((48, 32)))
    x = (u * np.geomspace(10.0, 0.1, 32)) @ v.T + 0.3 * rng.standard_normal((32, 48))
    params = {"w": jnp.asarray(x, jnp.float32), "b": jnp.zeros((48,))}
    config = SalaadConfig(rate_rank=0.25, rate_sparsity=0.1, rho=1e-3, kI_alpha=0.5,
                          kI_beta=0.05, pd_start=100)
    # With X fixed and the dual on, Y/ρ integrates the residual and races the thresholds (in
    # training X moves instead); the spec's controller check uses the monotone plant.
    state, history = _run_admm(params, salaad_init(params, config), config, 300, dual=False)
    first, last = np.asarray(history[:5]), np.asarray(history[-50:]).mean(axis=0)
    assert abs(first[:, 0].mean() - 0.25) > 0.3  # starts far: α = 0 keeps every direction
    assert abs(last[0] - 0.25) < 0.04 and abs(last[1] - 0.1) < 0.03
    assert state.low_rank["b"].shape == (1,)  # only selected leaves are touched
    stats = salaad_stats(params, state)
    assert set(stats) == {"w"} and stats["w"]["rank_threshold"] > 0
    frozen = SalaadConfig(rate_rank=0.25, rho=1e-3, kI_alpha=0.0, kD_alpha=0.0, kI_beta=0.0,
                          kD_beta=0.0)
    state, _ = _run_admm(params, salaad_init(params, frozen), frozen, 5)
    assert float(state.alpha["w"]) == 0.0 and float(state.beta["w"]) == 0.0


def _trained_state():
    l0, s0 = _rpca_problem(32, 48, rank=6, frac=0.1, seed=5)
    params = {"a": l0 + s0, "b": (l0 + s0)[:16].T, "bias": jnp.zeros((48,))}
    config = SalaadConfig(rho=0.05, kI_alpha=0.0, kD_alpha=0.0, kI_beta=0.0, kD_beta=0.0)
    state = salaad_init(params, config)
    state = state._replace(alpha={"a": jnp.asarray(0.05), "b": jnp.asarray(0.05),
                                  "bias": jnp.asarray(0.0)},
                           beta={"a": jnp.asarray(0.01), "b": jnp.asarray(0.01),
                                 "bias": jnp.asarray(0.0)})
    step = jax.jit(lambda st: salaad_admm_step(params, st, config))
    for _ in range(60):
        state = step(state)
    return params, state


def test_hpa_allocator_respects_budgets():
    params, state = _trained_state()
    total = sum(x.size for x in jax.tree.leaves(params))
    counts = surrogate_counts(state)
    full = 48 + sum(r * (m + n) + k for r, k, m, n in counts.values())
    untruncated = hpa_allocate(state, total, full + 10)
    assert untruncated.ranks == {p: c[0] for p, c in counts.items()}
    assert untruncated.n_params == full
    for fraction in (0.3, 0.5, 0.7):
        target = int(fraction * full)
        alloc = hpa_allocate(state, total, target)
        assert alloc.n_params <= target
        assert target - alloc.n_params <= 48 + 32 + 2 * len(counts)  # within ~a row + column
    low_only = hpa_allocate(state, total, int(0.8 * full), gamma=1.0)
    # γ = 1: the whole reduction comes from L; S is never cut (the post-fix may only add the
    # rounding slack to it).
    assert all(low_only.nnz[p] >= counts[p][1] for p in counts)
    assert sum(low_only.nnz.values()) - sum(c[1] for c in counts.values()) <= 48 + 32
    assert all(low_only.ranks[p] < counts[p][0] for p in counts)
    assert low_only.n_params <= int(0.8 * full)
    with pytest.raises(ValueError, match="gamma"):
        hpa_allocate(state, total, full, gamma=2.0)
    alloc = hpa_allocate(state, total, int(0.5 * full))
    factored = hpa_materialize(state, alloc, factored=True)
    dense = hpa_materialize(state, alloc, factored=False)
    x = np.asarray(_rng(0).standard_normal((3, 32)), np.float32)
    left, right, (rows, cols, values) = factored[("a",)]
    sparse = np.zeros((32, 48), np.float32)
    sparse[rows, cols] = values
    np.testing.assert_allclose(x @ left @ right + x @ sparse, x @ dense[("a",)], atol=1e-4)
    assert left.shape[1] == alloc.ranks[("a",)] and values.size == alloc.nnz[("a",)]
    swapped = apply_surrogate(params, state, alloc)
    np.testing.assert_allclose(swapped["a"], dense[("a",)], atol=1e-6)
    np.testing.assert_allclose(swapped["bias"], params["bias"])


def test_transform_composes_with_optax_and_sharding():
    params = {"w": jnp.asarray(_rng(2).standard_normal((16, 24)), jnp.float32),
              "b": jnp.zeros((24,))}
    grads = jax.tree.map(jnp.ones_like, params)
    config = SalaadConfig(rho=0.1, every=1)
    tx = optax.chain(scale_by_salaad(config), optax.scale(-0.01))
    state = tx.init(params)
    out, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_allclose(out["b"], -0.01)  # 1-D leaves pass through untouched
    # step 0: no ADMM block yet, L = S = Y = 0, so the pull is ρX
    np.testing.assert_allclose(out["w"], -0.01 * (1.0 + 0.1 * params["w"]), rtol=1e-6)
    # at step 1 the ADMM block runs first, then the pull ρ(X − L − S + Y/ρ) is added
    out, state = jax.jit(tx.update)(grads, state, params)
    sstate = find_salaad_state(state)
    want = 1.0 + 0.1 * (params["w"] - sstate.low_rank["w"] - sstate.sparse["w"]
                        + sstate.dual["w"] / 0.1)
    np.testing.assert_allclose(out["w"], -0.01 * want, rtol=1e-5, atol=1e-7)
    assert int(sstate.updates) == 1
    inject = optax.inject_hyperparams(salaad)(learning_rate=1e-3)
    istate = inject.init(params)
    _, istate = jax.jit(inject.update)(grads, istate, params)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    specs = {"w": P(None, "fsdp"), "b": P("fsdp")}
    put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)
    tx = salaad(1e-3, SalaadConfig(every=1))
    sharded, plain = tx.init(put(params)), tx.init(params)
    types0 = jax.tree.map(jax.typeof, sharded[0])  # SALAAD's part (AdamW's count is optax's)
    update = jax.jit(tx.update)
    for _ in range(2):
        u_s, sharded = update(put(grads), sharded, put(params))
        u_p, plain = update(grads, plain, params)
        assert jax.tree.map(jax.typeof, sharded[0]) == types0
        np.testing.assert_allclose(u_s["w"], u_p["w"], rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="params"):
        scale_by_salaad().update(grads, scale_by_salaad().init(params))
    with pytest.raises(ValueError, match="rate_rank"):
        SalaadConfig(rate_rank=1.5)
