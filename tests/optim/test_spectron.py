"""Tests for lowrank_jax.optim.spectron against the spec's testable properties."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.core.linalg import power_iteration
from lowrank_jax.optim import (
    SpectronState,
    scale_by_spectron,
    spectron,
    spectron_with_adamw,
)

MUON = (3.4445, -4.7750, 2.0315)


def _rand(rng, shape, scale=1.0):
    return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)


def _pair_params(seed=0, m=24, r=6, n=20, scale=0.5):
    rng = np.random.default_rng(seed)
    return {"layer": {"a": _rand(rng, (m, r), scale), "b": _rand(rng, (r, n), scale)}}


def _grads(seed, params, scale=1.0):
    rng = np.random.default_rng(1000 + seed)
    return jax.tree.map(lambda p: _rand(rng, p.shape, scale), params)


def _norm2(x):
    return float(np.linalg.norm(np.asarray(x, np.float64), 2))


def _delta_w(params, updates):
    a, b = params["layer"]["a"], params["layer"]["b"]
    ua, ub = updates["layer"]["a"], updates["layer"]["b"]
    return (np.asarray(a + ua, np.float64) @ np.asarray(b + ub, np.float64)
            - np.asarray(a, np.float64) @ np.asarray(b, np.float64))


# ---------------------------------------------------------------- property 3: update bound


def test_exact_polar_and_norms_bound_delta_w():
    params = _pair_params(0)
    tx = optax.inject_hyperparams(spectron, static_args=("ns_steps", "power_iters", "pair_fn"))(
        learning_rate=0.1, ns_coeffs="exact", exact_norm=True)
    state = tx.init(params)
    update = jax.jit(tx.update)
    sa, sb = _norm2(params["layer"]["a"]), _norm2(params["layer"]["b"])
    for eta in (0.01, 0.3, 1.0):
        state.hyperparams["learning_rate"] = jnp.asarray(eta)
        updates, _ = update(_grads(0, params), state, params)
        assert np.linalg.norm(_delta_w(params, updates), 2) <= eta * (1 + 1e-5)
        rho = eta / (sa + sb + 1.0)
        np.testing.assert_allclose(_norm2(updates["layer"]["a"]), rho, rtol=1e-5)
        np.testing.assert_allclose(_norm2(updates["layer"]["b"]), rho, rtol=1e-5)


def test_ns5_and_warm_power_iteration_bound_over_steps():
    eta = 0.2
    params = _pair_params(1)
    tx = spectron(eta)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(6):
        v = state[0].v["layer"]
        sigma_a, _ = power_iteration(params["layer"]["a"], v["a"])
        sigma_b, _ = power_iteration(params["layer"]["b"].T, v["b"])
        rho_hat = eta / (float(sigma_a) + float(sigma_b) + 1.0)
        sa, sb = _norm2(params["layer"]["a"]), _norm2(params["layer"]["b"])
        assert rho_hat >= eta / (sa + sb + 1.0) * (1 - 1e-6)  # σ̂ never overestimates
        updates, state = update(_grads(step, params), state, params)
        assert np.linalg.norm(_delta_w(params, updates), 2) <= 1.25 * eta
        for name in ("a", "b"):  # ‖u‖₂ = ρ̂·‖NS(M)‖₂ with ‖NS(M)‖₂ in the NS range
            assert 0.6 * rho_hat <= _norm2(updates["layer"][name]) <= 1.2 * rho_hat
        params = optax.apply_updates(params, updates)


# ------------------------------------------------------- property 4: gradient-scale invariance


def test_gradient_scale_invariance():
    params0 = _pair_params(2)
    tx = spectron(0.05)
    update = jax.jit(tx.update)
    results = []
    for c in (1e-3, 1.0, 1e3):
        params, state = params0, tx.init(params0)
        trace = []
        for step in range(5):
            updates, state = update(_grads(step, params0, scale=c), state, params)
            params = optax.apply_updates(params, updates)
            trace.append(updates)
        results.append(trace)
    for trace in results[::2]:
        for got, want in zip(jax.tree.leaves(trace), jax.tree.leaves(results[1])):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_composes_after_clip_by_global_norm():
    params = _pair_params(2)
    grads = _grads(2, params, scale=10.0)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), spectron(0.05))
    got, _ = jax.jit(clipped.update)(grads, clipped.init(params), params)
    plain = spectron(0.05)
    want, _ = jax.jit(plain.update)(grads, plain.init(params), params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # NS removes the clip scale
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------- property 5: zero factor


def test_zero_b_gives_exactly_zero_a_update():
    params = _pair_params(3)
    params["layer"]["b"] = jnp.zeros_like(params["layer"]["b"])
    x = _rand(np.random.default_rng(3), (5, 24))

    def loss(p):
        return jnp.sum(jnp.sin(x @ p["layer"]["a"] @ p["layer"]["b"]))

    tx = spectron(0.1)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(2):
        updates, state = step(jax.grad(loss)(params), state, params)
        assert float(jnp.abs(updates["layer"]["a"]).max()) == 0.0
        assert bool(jnp.all(jnp.isfinite(updates["layer"]["b"])))
        assert float(jnp.abs(updates["layer"]["b"]).max()) > 0.0
        assert all(bool(jnp.all(jnp.isfinite(t))) for t in jax.tree.leaves(state))


def test_zero_momentum_gives_zero_update():
    params = _pair_params(4)
    tx = spectron(0.1)
    updates, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params),
                                        params)
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
    assert all(bool(jnp.all(jnp.isfinite(t))) for t in jax.tree.leaves(state))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_non_finite_gradient_skips_step(bad):
    params = _pair_params(5)
    tx = spectron(0.1, weight_decay=0.1)
    update = jax.jit(tx.update)
    _, state = update(_grads(0, params), tx.init(params), params)
    grads = _grads(1, params)
    grads["layer"]["b"] = grads["layer"]["b"].at[0, 0].set(bad)
    updates, new_state = update(grads, state, params)
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
    inner_old, inner_new = state[0], new_state[0]
    for old, new in zip(jax.tree.leaves(inner_old), jax.tree.leaves(inner_new)):
        np.testing.assert_array_equal(old, new)


# ------------------------------------------------------------ property 7: NumPy reference parity


def _np_ns(m, steps=5, coeffs=MUON, eps=1e-7):
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / (np.linalg.norm(x) + eps)
    a, b, c = coeffs
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if m.shape[0] > m.shape[1] else x


def _np_power(mat, v):
    v = v / np.linalg.norm(v)
    u = mat @ v
    u = u / np.linalg.norm(u)
    v = mat.T @ u
    v = v / np.linalg.norm(v)
    return u @ mat @ v, v


def _np_spectron(params, grads_seq, v_init, eta, beta, wd, nesterov):
    """Per-pair Spectron written from the spec (weight decay η·λ, EMA momentum, shared ρ)."""
    a, b = (np.asarray(params["layer"][k], np.float64) for k in ("a", "b"))
    mu = {"a": np.zeros_like(a), "b": np.zeros_like(b)}
    v = {k: np.asarray(v_init[k], np.float64) for k in ("a", "b")}
    out = []
    for grads in grads_seq:
        g = {k: np.asarray(grads["layer"][k], np.float64) for k in ("a", "b")}
        ortho = {}
        for k in ("a", "b"):
            mu[k] = beta * mu[k] + (1 - beta) * g[k]
            ortho[k] = _np_ns(beta * mu[k] + (1 - beta) * g[k] if nesterov else mu[k])
        sa, v["a"] = _np_power(a, v["a"])
        sb, v["b"] = _np_power(b.T, v["b"])
        rho = eta / (sa + sb + 1.0)
        ua, ub = -rho * ortho["a"] - eta * wd * a, -rho * ortho["b"] - eta * wd * b
        a, b = a + ua, b + ub
        out.append((ua, ub))
    return out


@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_numpy_reference_for_three_steps(nesterov):
    params = _pair_params(6)
    eta, beta, wd = 0.05, 0.9, 0.1
    tx = spectron(eta, momentum=beta, weight_decay=wd, nesterov=nesterov)
    state = tx.init(params)
    v_init = {k: state[0].v["layer"][k] for k in ("a", "b")}
    grads_seq = [_grads(s, params) for s in range(3)]
    want = _np_spectron(params, grads_seq, v_init, eta, beta, wd, nesterov)
    update = jax.jit(tx.update)
    for grads, (ua, ub) in zip(grads_seq, want):
        updates, state = update(grads, state, params)
        np.testing.assert_allclose(updates["layer"]["a"], ua, atol=1e-5)
        np.testing.assert_allclose(updates["layer"]["b"], ub, atol=1e-5)
        params = optax.apply_updates(params, updates)


# -------------------------------------------------------------- state, jit, schedules, errors


def _two_pairs(seed=7):
    rng = np.random.default_rng(seed)
    return {"q": {"a": _rand(rng, (16, 4)), "b": _rand(rng, (4, 12))},
            "up": {"a": _rand(rng, (12, 3)), "b": _rand(rng, (3, 20))}}


def test_state_structure_and_jit_parity():
    params = _two_pairs()
    params["up"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["up"])
    tx = spectron(optax.linear_schedule(0.0, 0.1, 4))
    state0 = tx.init(params)
    inner = state0[0]
    assert isinstance(inner, SpectronState)
    assert inner.count.dtype == jnp.int32
    assert inner.mu["up"]["a"].dtype == jnp.float32  # momentum fp32 even for bf16 params
    assert inner.v["q"]["a"].shape == (4,) and inner.v["q"]["b"].shape == (4,)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), _grads(0, params), params)
    update = jax.jit(tx.update)
    jit_u, jit_s = update(grads, state0, params)
    assert float(jnp.abs(jit_u["q"]["a"]).max()) == 0.0  # the schedule starts at η=0
    assert jax.tree.structure(jit_s) == jax.tree.structure(state0)
    for before, after in zip(jax.tree.leaves(state0), jax.tree.leaves(jit_s)):
        assert before.shape == after.shape and before.dtype == after.dtype
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), _grads(1, params), params)
    jit_u, new_s = update(grads, jit_s, params)
    assert jit_u["up"]["a"].dtype == jnp.bfloat16 and jit_u["q"]["a"].dtype == jnp.float32
    # Without jit (op by op) on the fp32 pair: the same numbers.
    sub = {"q": params["q"]}
    sub_state = (inner._replace(count=jit_s[0].count, mu={"q": jit_s[0].mu["q"]},
                                v={"q": jit_s[0].v["q"]}), jit_s[1])
    eager_u, eager_s = tx.update({"q": grads["q"]}, sub_state, sub)
    jit_sub = ({"q": jit_u["q"]}, (new_s[0]._replace(mu={"q": new_s[0].mu["q"]},
                                                     v={"q": new_s[0].v["q"]}), new_s[1]))
    for got, want in zip(jax.tree.leaves(jit_sub), jax.tree.leaves((eager_u, eager_s))):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(jit_u["q"]["a"]).max()) > 0.0


def test_sharded_explicit_mesh_matches_unsharded():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(8)
    params = {"p": {"a": _rand(rng, (64, 4)), "b": _rand(rng, (4, 32))}}
    specs = {"p": {"a": P("fsdp", None), "b": P(None, "fsdp")}}
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    tx = spectron(0.05)
    update = jax.jit(tx.update)
    state_s, state_u = tx.init(sharded), tx.init(params)
    types0 = jax.tree.map(jax.typeof, state_s)
    p_s, p_u = sharded, params
    for step in range(2):
        grads = _grads(step, params)
        g_s = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), grads, specs)
        u_s, state_s = update(g_s, state_s, p_s)
        u_u, state_u = update(grads, state_u, p_u)
        for got, want in zip(jax.tree.leaves(u_s), jax.tree.leaves(u_u)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert jax.tree.map(jax.typeof, state_s) == types0
        assert jax.typeof(u_s["p"]["a"]).sharding.spec == P("fsdp", None)
        p_s, p_u = optax.apply_updates(p_s, u_s), optax.apply_updates(p_u, u_u)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_layout_and_argument_errors():
    with pytest.raises(ValueError, match="kernel"):
        spectron(0.1).init({"x": {"kernel": jnp.ones((3, 3))}})
    with pytest.raises(ValueError, match="rank"):
        spectron(0.1).init({"x": {"a": jnp.ones((4, 2)), "b": jnp.ones((3, 4))}})
    with pytest.raises(ValueError, match="momentum"):
        scale_by_spectron(momentum=1.0)
    with pytest.raises(ValueError, match="wd_scale"):
        spectron(0.1, wd_scale="lr")
    with pytest.raises(ValueError, match="coeffs"):
        spectron(0.1, ns_coeffs=(1.0, 2.0))


def test_rho_weight_decay_scale():
    params = _pair_params(9)
    grads = _grads(9, params)
    eta, wd = 0.1, 0.5
    plain = spectron(eta, ns_coeffs="exact", exact_norm=True)
    decayed = spectron(eta, ns_coeffs="exact", exact_norm=True, weight_decay=wd, wd_scale="rho")
    u0, _ = plain.update(grads, plain.init(params), params)
    u1, _ = decayed.update(grads, decayed.init(params), params)
    rho = eta / (_norm2(params["layer"]["a"]) + _norm2(params["layer"]["b"]) + 1.0)
    np.testing.assert_allclose(u1["layer"]["a"] - u0["layer"]["a"],
                               -rho * wd * params["layer"]["a"], atol=1e-6)


# ------------------------------------------------------------- nnx.Optimizer on a factorized Llama


def test_nnx_optimizer_on_factorized_llama_reduces_loss():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                      projection="factorized")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.normal(size=s.shape), s.dtype), state)
    model = nnx.merge(graphdef, state)
    optimizer = nnx.Optimizer(model, spectron_with_adamw(0.05, 1e-2, weight_decay=0.01),
                              wrt=nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 12)), jnp.int32)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        def loss_fn(m):
            logits, _ = m(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    a_before = np.asarray(model.layers[0].mlp.up_proj.a[...])
    losses = [float(train_step(model, optimizer, tokens)) for _ in range(4)]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.05, losses
    assert not np.allclose(a_before, np.asarray(model.layers[0].mlp.up_proj.a[...]))


def test_batched_pairs_equal_the_per_pair_loop():
    """Pairs of equal shape run as one vmapped computation; the result is the per-pair loop's."""
    keys = jax.random.split(jax.random.key(3), 12)
    shapes = [((16, 4), (4, 8))] * 3 + [((8, 2), (2, 16))] * 2 + [((5, 3), (3, 7))]
    params = {f"p{i}": {"a": jax.random.normal(keys[2 * i], sa),
                        "b": jax.random.normal(keys[2 * i + 1], sb)}
              for i, (sa, sb) in enumerate(shapes)}
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    outs = {}
    for batched in (True, False):
        tx = scale_by_spectron(weight_decay=0.1, batch_pairs=batched)
        state = tx.init(params)
        for _ in range(2):
            updates, state = jax.jit(tx.update)(grads, state, params)
        outs[batched] = (updates, state)
    # the same maths in another summation order: float32 Newton-Schulz over 2 steps differs by
    # up to ~4e-5 relative (XLA's fusion emitters decide the order)
    for got, want in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(outs[True][0]["p0"]["a"]).max()) > 0
