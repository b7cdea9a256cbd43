"""CrispEdit projector: Kronecker equivalence, threshold, curvature bound, first order, optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.curvature import kfac
from lowrank_jax.optim import crispedit as ce


def random_psd(key, n, dtype=jnp.float32):
    m = jax.random.normal(key, (n, n + 2), dtype)
    return m @ m.T / n


def random_factor(seed, d_in, d_out, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return kfac.KFACFactor(random_psd(k1, d_in, dtype), random_psd(k2, d_out, dtype),
                           jnp.array(1.0, dtype))


def explicit_projector(proj):
    """(kron(U_A,U_G) diag(vec M) kron(U_A,U_G)ᵀ), the dense (d_in·d_out)² projector."""
    U = jnp.kron(proj.U_A, proj.U_G)
    mask = ce.keep_mask(proj).reshape(-1).astype(U.dtype)
    return U @ jnp.diag(mask) @ U.T


@pytest.mark.parametrize("energy", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.float64, 1e-12)])
def test_matrix_free_equals_explicit_kronecker(energy, dtype, tol):
    with jax.enable_x64(dtype == jnp.float64):
        proj = ce.layer_projector(random_factor(0, 5, 4, dtype), energy)
        x = jax.random.normal(jax.random.key(1), (5, 4), dtype)
        y = jax.random.normal(jax.random.key(2), (5, 4), dtype)
        px = ce.kron_project(x, *proj)
        expected = (explicit_projector(proj) @ x.reshape(-1)).reshape(5, 4)
        np.testing.assert_allclose(px, expected, atol=tol)
        # idempotent, to a few float32 ulp
        np.testing.assert_allclose(ce.kron_project(px, *proj), px, atol=tol, rtol=10 * tol)
        np.testing.assert_allclose(jnp.vdot(px, y), jnp.vdot(x, ce.kron_project(y, *proj)),
                                   atol=tol * 10)  # symmetric
        # PyTorch layout (d_out, d_in): the same projector with the factors' roles swapped
        proj_t = ce.LayerProjector(proj.U_G, proj.lam_G, proj.U_A, proj.lam_A, proj.tau)
        np.testing.assert_allclose(ce.kron_project(x.T, *proj_t), px.T, atol=tol)
        assert 0 < int(ce.keep_mask(proj).sum()) < 20


@pytest.mark.parametrize("energy", [0.3, 0.8, 0.9, 0.99])
def test_threshold_bisection_equals_sort_and_removes_energy(energy):
    with jax.enable_x64(True):
        f = random_factor(3, 12, 9, jnp.float64)
        b = kfac.eigenbasis(f)
        tau = ce.energy_threshold(b.lam_A, b.lam_G, energy)
        np.testing.assert_allclose(tau, ce.energy_threshold_sorted(b.lam_A, b.lam_G, energy),
                                   rtol=1e-12)
        prods = np.sort(np.asarray(jnp.outer(b.lam_A, b.lam_G)).ravel())[::-1]
        total = prods.sum()
        removed = prods[prods >= float(tau)]
        assert removed.sum() / total >= energy
        assert (removed.sum() - removed[-1]) / total < energy  # minimal
    # float32 bisection on a real-sized spectrum agrees with the sort
    b32 = kfac.eigenbasis(random_factor(4, 64, 48))
    np.testing.assert_allclose(ce.energy_threshold(b32.lam_A, b32.lam_G, 0.9),
                               ce.energy_threshold_sorted(b32.lam_A, b32.lam_G, 0.9), rtol=1e-6)


def test_threshold_edge_cases():
    lam_A = jnp.array([0.0, 1.0, 2.0])
    lam_G = jnp.array([0.0, 3.0])
    tau1 = ce.energy_threshold(lam_A, lam_G, 1.0)
    proj = ce.LayerProjector(jnp.eye(3), lam_A, jnp.eye(2), lam_G, tau1)
    keep = np.asarray(ce.keep_mask(proj))
    np.testing.assert_array_equal(keep, np.outer(lam_A, lam_G) == 0)  # only zero curvature
    tau_small = ce.energy_threshold(lam_A, lam_G, 1e-6)
    assert float(tau_small) == 6.0  # only the top direction removed
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="energy"):
            ce.build_projector({}, bad)


@pytest.mark.parametrize("energy", [0.5, 0.9])
def test_strict_curvature_bound(energy):
    f = random_factor(5, 7, 6)
    proj = ce.layer_projector(f, energy)
    for seed in range(3):
        delta = ce.kron_project(jax.random.normal(jax.random.key(seed), (7, 6)), *proj)
        curv = jnp.trace(f.A @ delta @ f.G @ delta.T)
        assert float(curv) <= float(proj.tau) * float(jnp.sum(delta**2)) * (1 + 1e-4) + 1e-7


class TanhMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(10, 16, use_bias=False, rngs=rngs)
        self.fc2 = nnx.Linear(16, 5, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def test_projected_edit_update_preserves_capability_loss_to_first_order():
    model = TanhMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (256, 10))
    cap = {"inputs": x, "labels": jnp.argmax(x[:, :5], -1)}
    factors = kfac.estimate_kfac_factors(model, [cap], targets="fc1")
    projector = ce.build_projector(factors, 0.9)
    assert 0 < float(jnp.mean(ce.keep_mask(projector["fc1"]))) < 1
    graphdef, kernels, rest = nnx.split(model, lambda path, v: path[-1] == "kernel" and
                                        path[0] == "fc1", ...)

    @jax.jit
    def loss_and_grads(kernels, batch):
        def loss(kernels):
            logp = jax.nn.log_softmax(nnx.merge(graphdef, kernels, rest)(batch["inputs"]))
            return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))
        return jax.grad(loss)(kernels)["fc1"]["kernel"][...]

    grad_cap = loss_and_grads(kernels, cap)
    raw, projected = [], []
    for seed in range(6):  # "edits": new points with arbitrary labels
        edit = {"inputs": jax.random.normal(jax.random.key(20 + seed), (1, 10)),
                "labels": jnp.array([seed % 5])}
        g_edit = loss_and_grads(kernels, edit)
        raw.append(abs(float(jnp.vdot(grad_cap, g_edit))))
        projected.append(abs(float(jnp.vdot(grad_cap,
                                            ce.project_update(g_edit, projector["fc1"])))))
    assert np.mean(projected) * 10 <= np.mean(raw), (projected, raw)


def _params_and_projector():
    params = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (8, 6))},
              "bias": jnp.ones((6,))}
    projector = ce.build_projector({"dense": random_factor(1, 8, 6)}, 0.9)
    return params, projector


@pytest.mark.parametrize("order", ["strict", "faithful"])
def test_optax_orders_jit_and_unmatched(order):
    params, projector = _params_and_projector()
    grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.3, params)
    tx = ce.crispedit_adam(projector, 1e-2, order=order)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    proj = projector["dense"]
    if order == "strict":  # final update exactly in the kept subspace
        np.testing.assert_allclose(ce.project_update(updates["dense"]["kernel"], proj),
                                   updates["dense"]["kernel"], atol=1e-6)
    else:  # Adam saw the projected gradient
        mu = state[1][0].mu["dense"]["kernel"]
        np.testing.assert_allclose(mu, 0.1 * ce.project_update(grads["dense"]["kernel"], proj),
                                   atol=1e-6)
    assert float(jnp.abs(updates["bias"]).sum()) > 0  # unmatched leaf passes
    zero_tx = ce.scale_by_crispedit(projector, unmatched="zero")
    zeroed, _ = zero_tx.update(grads, zero_tx.init(params))
    np.testing.assert_array_equal(zeroed["bias"], 0.0)


def test_refresh_reprojects_adam_first_moment_under_masked():
    params, projector = _params_and_projector()
    mask = {"dense": {"kernel": True}, "bias": False}
    tx = optax.masked(optax.chain(ce.scale_by_crispedit(projector), optax.adam(1e-2)), mask)
    state = tx.init(params)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape), params)
    _, state = jax.jit(tx.update)(grads, state, params)
    new = ce.build_projector({"dense": random_factor(7, 8, 6)}, 0.5)
    refreshed = ce.crispedit_refresh(state, new)
    mu_old = state.inner_state[1][0].mu["dense"]["kernel"]
    mu_new = refreshed.inner_state[1][0].mu["dense"]["kernel"]
    np.testing.assert_allclose(mu_new, ce.project_update(mu_old, new["dense"]), atol=1e-6)
    np.testing.assert_array_equal(refreshed.inner_state[1][0].nu["dense"]["kernel"],
                                  state.inner_state[1][0].nu["dense"]["kernel"])
    assert refreshed.inner_state[0].projector["dense"].tau == new["dense"].tau
    moved = jax.tree.map(lambda x: x * 1.3, params)
    assert ce.needs_refresh(moved, params, projector)
    assert not ce.needs_refresh(params, params, projector)


@pytest.mark.parametrize("order", ["strict", "faithful"])
def test_state_sharding_unchanged_by_update(order):
    mesh = jax.make_mesh((8,), ("x",))
    params, projector = _params_and_projector()
    replicated = NamedSharding(mesh, P())
    params = {"dense": {"kernel": jax.device_put(params["dense"]["kernel"],
                                                 NamedSharding(mesh, P("x", None)))},
              "bias": jax.device_put(params["bias"], replicated)}
    projector = jax.device_put(projector, replicated)
    tx = ce.crispedit_adam(projector, 1e-2, order=order)
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        before = jax.tree.map(jax.typeof, state)
        _, new_state = jax.jit(tx.update)(params, state, params)
        assert jax.tree.map(jax.typeof, new_state) == before
