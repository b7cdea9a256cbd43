"""Transport clustering: feasibility, the registration identity, the approximation bound on tiny
instances solved exactly by enumeration, and parity with ott-jax's low-rank Sinkhorn."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.ot.transport_clustering import (
    full_rank_plan,
    gkmeans,
    gkmeans_factored,
    lr_cost,
    lr_cost_factored,
    plan_matrix,
    point_cost,
    register_cost,
    register_factors,
    sqeuclidean_factors,
    transport_clustering,
)


def _blobs(key, n=200, shift=(1.0, -0.5), k=4, sigma=0.5):
    kc, kx, ky = jax.random.split(key, 3)
    centers = 4.0 * jax.random.normal(kc, (k, 2))
    labels = jnp.arange(n) % k
    x = centers[labels] + sigma * jax.random.normal(kx, (n, 2))
    y = centers[labels] + sigma * jax.random.normal(ky, (n, 2)) + jnp.asarray(shift)
    return x, y, labels


def _random_q(key, n, k, a):
    Q = jax.random.uniform(key, (n, k), minval=0.1, maxval=1.0)
    return Q / Q.sum(1, keepdims=True) * a[:, None]


def _solve(key, *args, **kw):
    """``transport_clustering`` compiled as one program (op by op it compiles ~150 small ones)."""
    return jax.jit(lambda k: transport_clustering(k, *args, **kw))(key)


def test_feasibility_hard_and_soft_registration():
    x, y, _ = _blobs(jax.random.key(0), n=24)
    C = point_cost(x, y)
    a = b = jnp.full((24,), 1 / 24)
    soft = full_rank_plan(C, method="sinkhorn", epsilon_rel=1e-2, iterations=200)
    np.testing.assert_allclose(np.asarray(soft.sum(0)), np.asarray(b), atol=1e-6)
    np.testing.assert_allclose(np.asarray(soft.sum(1)), np.asarray(a), atol=1e-6)
    for registration in ("hungarian", soft):
        plan = _solve(jax.random.key(1), x=x, y=y, rank=3, iterations=100, restarts=1,
                      registration=registration)
        for M, w in ((plan.Q, a), (plan.R, b)):
            assert float(M.min()) >= 0
            np.testing.assert_allclose(np.asarray(M.sum(1)), np.asarray(w), atol=1e-6)
            np.testing.assert_allclose(np.asarray(M.sum(0)), np.asarray(plan.g), atol=1e-6)
        np.testing.assert_allclose(float(plan.cost), float(lr_cost(C, plan.Q, plan.R, plan.g)),
                                   rtol=1e-5)


@pytest.mark.slow
def test_registration_identity_soft_plan():
    x, y, _ = _blobs(jax.random.key(2), n=30)
    C = point_cost(x, y)
    a = jnp.full((30,), 1 / 30)
    P = full_rank_plan(C, method="sinkhorn", epsilon_rel=5e-2, iterations=300)
    P = P / P.sum(1, keepdims=True) * a[:, None]  # exact row marginals for the identity
    Q = _random_q(jax.random.key(3), 30, 4, a)
    g = Q.sum(0)
    R = P.T @ (Q / a[:, None])
    C_reg = register_cost(C, P, a)
    f = jnp.sum(jnp.sum(Q * (C_reg @ Q), 0) / g)
    np.testing.assert_allclose(float(lr_cost(C, Q, R, g)), float(f), rtol=1e-5)
    np.testing.assert_allclose(float(jnp.sum(plan_matrix(Q, R, g) * C)), float(f), rtol=1e-5)
    A, B = sqeuclidean_factors(x, y)
    _, B_rot = register_factors(A, B, P, a)
    np.testing.assert_allclose(np.asarray(A @ B_rot.T), np.asarray(C_reg), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(float(lr_cost_factored(A, B, Q, R, g)), float(f), rtol=1e-4)


@pytest.mark.slow
def test_extremes_rank_one_and_rank_n():
    x, y, _ = _blobs(jax.random.key(4), n=12)
    C = point_cost(x, y)
    a = jnp.full((12,), 1 / 12)
    plan1 = transport_clustering(jax.random.key(0), C, rank=1, iterations=10, restarts=1)
    np.testing.assert_allclose(float(plan1.cost), float(a @ C @ a), rtol=1e-5)
    perm = full_rank_plan(C)
    ot = float(C[jnp.arange(12), perm].mean())
    Q = jnp.diag(a)
    R = Q[jnp.argsort(perm)]
    np.testing.assert_allclose(float(lr_cost(C, Q, R, Q.sum(0))), ot, rtol=1e-5)


def test_hungarian_matches_scipy_and_lp():
    from scipy.optimize import linear_sum_assignment

    C = jax.random.uniform(jax.random.key(5), (9, 9))
    perm = full_rank_plan(C)
    rows, cols = linear_sum_assignment(np.asarray(C))
    best = float(np.asarray(C)[rows, cols].sum())
    np.testing.assert_allclose(float(C[jnp.arange(9), perm].sum()), best, rtol=1e-6)
    P = full_rank_plan(C, method="lp")
    np.testing.assert_allclose(float(jnp.sum(P * C)) * 9, best, rtol=1e-5)


@functools.cache
def _subsets(n):
    """Indicator rows of every 2-labelling's first cluster (label 0 holds element 0)."""
    return np.array([(1,) + bits for bits in itertools.product((0, 1), repeat=n - 1)], float)


def _best_hard_cost(C_reg):
    """min over 2-labelings of ``Σ_k 1_kᵀ C̃ 1_k / (n |k|)`` (uniform marginals)."""
    n = C_reg.shape[0]
    U = _subsets(n)
    V = 1.0 - U
    part = lambda W: np.einsum("si,ij,sj->s", W, C_reg, W) / (n * np.maximum(W.sum(1), 1))
    return float(np.min(part(U) + part(V)))


def _exact_hard_opt(C):
    """min over all 2-labelings × permutations of the hard LR-OT cost (n = 6: 32 × 720)."""
    n = C.shape[0]
    return min(_best_hard_cost(C[:, list(p)]) for p in itertools.permutations(range(n)))


@pytest.mark.slow
@pytest.mark.parametrize("cost", ["euclidean", "sqeuclidean"])
def test_approximation_bound_brute_force(cost):
    n, violations, ratios = 6, 0, []
    solve = jax.jit(lambda k, C: transport_clustering(k, C, rank=2, iterations=300, restarts=3))
    for s in range(20):
        kx, ky = jax.random.split(jax.random.key(100 + s))
        x = jax.random.normal(kx, (n, 2))
        y = jax.random.normal(ky, (n, 2)) + 0.5
        C = np.asarray(point_cost(x, y, cost), np.float64)
        perm = np.asarray(full_rank_plan(jnp.asarray(C)))
        ot_full = C[np.arange(n), perm].mean()
        opt_hard = _exact_hard_opt(C)
        C_reg = np.asarray(register_cost(jnp.asarray(C), jnp.asarray(perm)), np.float64)
        tc_exact = _best_hard_cost(C_reg)
        bound = opt_hard + ot_full
        if cost == "sqeuclidean":
            bound += np.sqrt(2 * ot_full * opt_hard)
        violations += tc_exact > bound * (1 + 1e-6)
        assert tc_exact >= opt_hard * (1 - 1e-6) >= ot_full * (1 - 1e-6)
        # the practical solver (mirror descent, restarts) reaches the exact clustering optimum
        plan = solve(jax.random.key(s), jnp.asarray(C, jnp.float32))
        ratios.append(float(plan.cost) / tc_exact)
    assert violations == 0
    assert np.median(ratios) <= 1.0 + 1e-4 and max(ratios) <= 1.15


def test_factored_equals_dense():
    x, y, _ = _blobs(jax.random.key(6), n=50)
    C = point_cost(x, y)
    a = jnp.full((50,), 1 / 50)
    perm = full_rank_plan(C)
    Q0 = _random_q(jax.random.key(7), 50, 3, a)
    Qd, ld = gkmeans(jax.random.key(0), register_cost(C, perm), a, 3, init=Q0, iterations=200)
    A, B = sqeuclidean_factors(x, y)
    Qf, lf = gkmeans_factored(jax.random.key(0), *register_factors(A, B, perm), a, 3, init=Q0,
                              iterations=200)
    np.testing.assert_allclose(np.asarray(Qf), np.asarray(Qd), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lf), np.asarray(ld), rtol=1e-4)
    assert float(ld[-1]) < float(ld[0])  # the objective decreased


@pytest.mark.slow
def test_invariances_permutation_and_scale():
    x, y, _ = _blobs(jax.random.key(8), n=40)
    C = point_cost(x, y)
    a = jnp.full((40,), 1 / 40)
    perm = full_rank_plan(C)
    C_reg = register_cost(C, perm)
    Q0 = _random_q(jax.random.key(9), 40, 3, a)
    Q, _ = gkmeans(jax.random.key(0), C_reg, a, 3, init=Q0, iterations=300)
    pi = jax.random.permutation(jax.random.key(10), 40)
    Qp, _ = gkmeans(jax.random.key(0), C_reg[pi][:, pi], a, 3, init=Q0[pi], iterations=300)
    np.testing.assert_allclose(np.asarray(Qp), np.asarray(Q[pi]), atol=1e-5)
    Qs, _ = gkmeans(jax.random.key(0), 7.0 * C_reg, a, 3, init=Q0, iterations=300)
    np.testing.assert_array_equal(np.asarray(Qs.argmax(1)), np.asarray(Q.argmax(1)))
    solve = jax.jit(lambda x, y: transport_clustering(jax.random.key(1), x=x, y=y, rank=3,
                                                      iterations=100, restarts=1))
    p1, p2 = solve(x, y), solve(x + 3.0, y + 3.0)  # one compile for both
    np.testing.assert_allclose(float(p2.cost), float(p1.cost), rtol=1e-3)


def _adjusted_rand(u, v):
    u, v = np.asarray(u), np.asarray(v)
    table = np.array([[np.sum((u == i) & (v == j)) for j in np.unique(v)] for i in np.unique(u)])
    comb = lambda t: (t * (t - 1) / 2).sum()
    total, rows, cols = comb(np.array(len(u))), comb(table.sum(1)), comb(table.sum(0))
    expected = rows * cols / total
    return (comb(table) - expected) / ((rows + cols) / 2 - expected)


def test_planted_co_clusters_recovered():
    x, y, labels = _blobs(jax.random.key(11), n=120, shift=(0.7, 0.3), sigma=0.3)
    plan = _solve(jax.random.key(2), x=x, y=y, rank=4, iterations=500, restarts=3)
    assert _adjusted_rand(labels, plan.labels_x) >= 0.95
    assert _adjusted_rand(labels, plan.labels_y) >= 0.95
    perm = full_rank_plan(point_cost(x, y))
    assert float(plan.cost) >= float(point_cost(x, y)[jnp.arange(120), perm].mean())


@pytest.mark.slow
def test_versus_ott_low_rank_sinkhorn():
    try:
        from ott.geometry import pointcloud
        from ott.initializers.linear import initializers_lr
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn_lr
    except ImportError as err:  # a test dependency, never a library one
        raise AssertionError("this test needs ott-jax: pip install ott-jax==0.6.0") from err
    x, y, _ = _blobs(jax.random.key(0), n=200)
    C = point_cost(x, y)
    plan = jax.jit(lambda k: transport_clustering(k, x=x, y=y, rank=4, iterations=2000,
                                                  restarts=3))(jax.random.key(1))
    prob = linear_problem.LinearProblem(pointcloud.PointCloud(x, y, scale_cost="max_cost"))
    solver = sinkhorn_lr.LRSinkhorn(rank=4, initializer=initializers_lr.KMeansInitializer(rank=4),
                                    max_iterations=2000)
    run = jax.jit(lambda k: solver(prob, rng=k))
    ott_costs = [float(lr_cost(C, o.q, o.r, o.g)) for o in map(run, jax.random.split(
        jax.random.key(2), 3))]
    assert float(plan.cost) <= 1.02 * min(ott_costs)


def test_bad_inputs_raise():
    C = jnp.ones((4, 5))
    with pytest.raises(ValueError, match="hungarian"):
        full_rank_plan(C)
    with pytest.raises(ValueError, match="rank"):
        transport_clustering(jax.random.key(0), jnp.ones((4, 4)), rank=9)
    with pytest.raises(ValueError, match="square"):
        gkmeans(jax.random.key(0), C, None, 2)
    with pytest.raises(ValueError, match="factored"):
        transport_clustering(jax.random.key(0), jnp.ones((4, 4)), rank=2, factored=True)


def test_factored_transport_clustering_matches_dense_for_hard_and_soft_registration():
    x, y, _ = _blobs(jax.random.key(12), n=16)
    soft = full_rank_plan(point_cost(x, y), method="sinkhorn", epsilon_rel=1e-2, iterations=100)
    for registration in ("hungarian", soft):
        kw = {"x": x, "y": y, "rank": 3, "iterations": 60, "restarts": 1,
              "registration": registration}
        dense = _solve(jax.random.key(3), **kw)
        fact = _solve(jax.random.key(3), factored=True, **kw)
        np.testing.assert_allclose(float(fact.cost), float(dense.cost), rtol=1e-4)
