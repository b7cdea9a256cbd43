"""LoRDO: local step invariants, sync algebra, stagnation, transport, exact communication."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.optim import (
    communication_per_sync,
    find_lordo_state,
    lordo,
    lordo_sync,
    scale_by_lordo,
    set_projection,
)

M, K, RANK = 4, 5, 2


def _grads(key, params, scale=1.0):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _sin_max_angle(q_old, q_new):
    return float(jnp.linalg.norm(q_new - q_old @ (q_old.T @ q_new), ord=2))


def test_shapes_sides_and_adam_fallback():
    params = {"wide": jnp.zeros((16, 40)), "tall": jnp.zeros((40, 16)), "bias": jnp.zeros((40,)),
              "small": jnp.zeros((8, 8))}
    tx = scale_by_lordo(rank=3)
    state = tx.init(params)
    assert state.projection["wide"].shape == (16, 3) and state.mu["wide"].shape == (3, 40)
    assert state.projection["tall"].shape == (16, 3) and state.mu["tall"].shape == (3, 40)
    assert state.error["tall"].shape == (16, 40)
    assert state.projection["bias"].shape == (1,) and state.mu["small"].shape == (8, 8)
    grads = _grads(jax.random.key(0), params)
    out, state = jax.jit(tx.update)(grads, state)
    assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, params)
    adam = optax.scale_by_adam(eps=1e-8)
    want, _ = adam.update(grads, adam.init(params))
    for name in ("bias", "small"):  # fallback leaves: exactly Adam
        np.testing.assert_allclose(out[name], want[name], rtol=1e-6, atol=1e-7)
    for name in ("wide", "tall"):  # Q is orthonormal and came from the first gradient
        q = state.projection[name]
        np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-5)
    # Right projection: the tall leaf's moments live on its column space side.
    stacked = jax.vmap(tx.update)(jax.tree.map(lambda g: jnp.stack([g, -g]), grads),
                                  jax.tree.map(lambda s: jnp.stack([s, s]), state))
    assert stacked[0]["tall"].shape == (2, 40, 16)


def test_error_feedback_identity_and_omega_one_in_span():
    params = {"w": jnp.zeros((20, 32))}
    tx = scale_by_lordo(rank=4, omega=1.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(3):
        grads = _grads(jax.random.key(step), params)
        old_error = state.error["w"]
        out, state = update(grads, state)
        q, e_new = state.projection["w"], state.error["w"]
        z = grads["w"] + old_error
        np.testing.assert_allclose(q @ (q.T @ z) + e_new, z, atol=1e-5)  # Qĝ + E_new = Ĝ + E
        np.testing.assert_allclose(q.T @ e_new, 0.0, atol=1e-5)
        d = out["w"]
        outside = d - q @ (q.T @ d)
        assert float(jnp.linalg.norm(outside)) <= 1e-6 * float(jnp.linalg.norm(d)) + 1e-7


def _problem(seed=0, shape=(16, 24)):
    """Worker m's loss 0.5‖W − T‖² + ⟨noise_m, W⟩: a full-rank target T."""
    rng = np.random.default_rng(seed)
    target = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return {"w": jnp.zeros(shape)}, target


def _run(omega, rounds, *, seed=0, transport="rotate"):
    params, target = _problem(seed)
    tx = lordo(0.05, rank=RANK, omega=omega, clip_norm=None, first_projection="set")
    anchor = params
    workers = jax.tree.map(lambda x: jnp.stack([x] * M), params)
    states = jax.vmap(tx.init)(workers)

    def grad_fn(p, key):
        return {"w": p["w"] - target + 0.1 * jax.random.normal(key, p["w"].shape)}

    keys = jax.random.split(jax.random.key(seed), M)
    states, floats0 = set_projection(states, jax.vmap(grad_fn)(workers, keys), stacked=True)

    @jax.jit
    def local_round(workers, states, key):
        def body(carry, k):
            w, s = carry
            g = jax.vmap(grad_fn)(w, jax.random.split(k, M))
            u, s = jax.vmap(tx.update)(g, s, w)
            return (optax.apply_updates(w, u), s), None

        return jax.lax.scan(body, (workers, states), jax.random.split(key, K))[0]

    sync = jax.jit(lambda w, a, s: lordo_sync(w, a, s, transport=transport))
    history = []
    for r in range(rounds):
        q_before = find_lordo_state(states).projection["w"][0]
        workers, states = local_round(workers, states, jax.random.key(100 + r))
        res = sync(workers, anchor, states)
        anchor, workers, states = res.anchor, res.worker_params, res.worker_opt_states
        q_after = find_lordo_state(states).projection["w"][0]
        loss = 0.5 * float(jnp.sum((anchor["w"] - target) ** 2))
        history.append((_sin_max_angle(q_before, q_after), loss, int(res.floats_sent)))
    return history, int(floats0), anchor, target, states


def test_stagnation_without_full_rank_term_and_rotation_with_it():
    stuck, _, _, target, states = _run(1.0, rounds=6)
    assert max(angle for angle, _, _ in stuck) < 1e-5  # the subspace never moves
    q0 = find_lordo_state(states).projection["w"][0]
    floor = 0.5 * float(jnp.sum((target - q0 @ (q0.T @ target)) ** 2))
    assert stuck[-1][1] >= floor * (1 - 1e-4)  # trapped in span(Q_0): loss can't go below floor
    moving, _, _, _, _ = _run(0.5, rounds=6)
    assert min(angle for angle, _, _ in moving) > 0.05  # the subspace rotates at every sync
    assert moving[-1][1] < moving[0][1] and moving[-1][1] < 0.9 * floor  # escapes the floor


def test_communication_counter_is_exact():
    history, floats0, anchor, _, _ = _run(0.9, rounds=3)
    per_sync = communication_per_sync(anchor)
    assert per_sync == 16 * 24
    assert [f for _, _, f in history] == [per_sync] * 3
    assert floats0 == 16 * 24  # step-0 projection: only low-rank leaves are all-reduced
    total = floats0 + sum(f for _, _, f in history)
    assert total == per_sync * 3 + 16 * 24


@pytest.mark.no_typecheck  # it also checks our own ValueError for transport="spin"
def test_sync_algebra_average_and_reset():
    params = {"w": jnp.zeros((16, 24)), "b": jnp.zeros((24,))}
    tx = lordo(0.1, rank=RANK)
    workers = jax.tree.map(lambda x: jnp.stack([x] * M), params)
    states = jax.vmap(tx.init)(workers)
    grads = _grads(jax.random.key(1), workers)
    updates, states = jax.vmap(tx.update)(grads, states)
    workers = optax.apply_updates(workers, updates)
    res = lordo_sync(workers, params, states)
    for name in ("w", "b"):
        np.testing.assert_allclose(res.anchor[name], jnp.mean(workers[name], axis=0), atol=1e-6)
        np.testing.assert_allclose(res.worker_params[name],
                                   jnp.broadcast_to(res.anchor[name], workers[name].shape))
    q = find_lordo_state(res.worker_opt_states).projection["w"]
    for m in range(1, M):
        np.testing.assert_allclose(q[m], q[0])  # identical global Q on every worker
    with pytest.raises(ValueError, match="transport"):
        lordo_sync(workers, params, states, transport="spin")


def test_rotate_transport_is_exact_for_signed_permutations():
    params = {"w": jnp.zeros((16, 24))}
    tx = scale_by_lordo(rank=3, omega=0.7)
    state = tx.init(params)
    for step in range(3):
        _, state = tx.update(_grads(jax.random.key(step), params), state)
    q_old = state.projection["w"]
    # A displacement inside span(Q_old) with increasing singular values: the SVD returns
    # Q_old's columns reversed (and possibly sign-flipped), i.e. Q_new = Q_old·Π.
    v = jnp.linalg.qr(jax.random.normal(jax.random.key(9), (24, 3)))[0]
    delta = q_old @ jnp.diag(jnp.array([1.0, 2.0, 3.0])) @ v.T
    stacked = lambda t: jax.tree.map(lambda x: x[None], t)
    res = lordo_sync(stacked({"w": delta}), params, stacked(state))
    moved = jax.tree.map(lambda x: x[0], res.worker_opt_states)
    assert not np.allclose(moved.projection["w"], q_old)  # the basis did change ...
    grads = _grads(jax.random.key(7), params)
    want, _ = tx.update(grads, state)
    got, _ = tx.update(grads, moved)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-4, atol=1e-6)  # ... the step didn't


def test_sync_under_shard_map_matches_single_host():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    params = {"w": jnp.zeros((16, 24)), "b": jnp.zeros((24,))}
    tx = lordo(0.1, rank=RANK)
    workers = jax.tree.map(lambda x: jnp.stack([x] * 8), params)
    states = jax.vmap(tx.init)(workers)
    updates, states = jax.vmap(tx.update)(_grads(jax.random.key(3), workers), states)
    workers = optax.apply_updates(workers, updates)
    want = lordo_sync(workers, params, states)

    def body(w, a, s):
        res = lordo_sync(w, a, s, axis_name="data")
        return res.anchor, res.worker_params, res.worker_opt_states, res.floats_sent

    spec_w = jax.tree.map(lambda _: P("data"), workers)
    spec_s = jax.tree.map(lambda _: P("data"), states)
    spec_a = jax.tree.map(lambda _: P(), params)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec_w, spec_a, spec_s),
                               out_specs=(spec_a, spec_w, spec_s, P())))
    put = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), t)
    anchor, new_workers, new_states, floats = fn(put(workers), params, put(states))
    np.testing.assert_allclose(anchor["w"], want.anchor["w"], atol=1e-6)
    np.testing.assert_allclose(new_workers["b"], want.worker_params["b"], atol=1e-6)
    q = find_lordo_state(new_states).projection["w"]
    q_want = find_lordo_state(want.worker_opt_states).projection["w"]
    np.testing.assert_allclose(jnp.abs(q.transpose(0, 2, 1) @ q_want[0]).sum(axis=(1, 2)),
                               RANK * np.ones(8), atol=1e-4)  # same span on every shard
    assert int(floats) == int(want.floats_sent) == communication_per_sync(params)


# structural integers must stay Python ints under inject_hyperparams (as for optax's own rank args)
LORDO_STATIC = ("rank", "min_dim_for_lowrank", "refresh_every")


def test_optax_composition_and_sharded_state():
    params = {"w": jnp.ones((16, 24)), "b": jnp.zeros((24,))}
    grads = _grads(jax.random.key(0), params)
    inject = optax.inject_hyperparams(lordo, static_args=LORDO_STATIC)(learning_rate=1e-3, rank=3,
                                                                      omega=0.5)
    state = inject.init(params)
    for _ in range(2):
        _, state = jax.jit(inject.update)(grads, state, params)
    assert state.inner_state[1].projection["w"].shape == (16, 3)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    specs = {"w": P(None, "fsdp"), "b": P("fsdp")}
    put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)
    tx = lordo(1e-3, rank=3, refresh_every=2)
    sharded, plain = tx.init(put(params)), tx.init(params)
    types0 = jax.tree.map(jax.typeof, sharded)
    update = jax.jit(tx.update)
    for _ in range(3):
        u_s, sharded = update(put(grads), sharded, put(params))
        u_p, plain = update(grads, plain, params)
        assert jax.tree.map(jax.typeof, sharded) == types0
        np.testing.assert_allclose(u_s["w"], u_p["w"], rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="rank"):
        scale_by_lordo(rank=0)
    with pytest.raises(ValueError, match="omega"):
        lordo(1e-3, omega=1.5)


def test_cli_optimizer_is_the_public_constructor():
    from lowrank_jax.train.config import OptimizerConfig
    from lowrank_jax.train.optimizers import build_optimizer, schedule

    cfg = OptimizerConfig(name="lordo", learning_rate=1e-3, rank=3, sync_every=2, omega=0.8)
    built = build_optimizer(cfg, steps=10)
    direct = lordo(schedule(1e-3, 10, cfg.warmup_fraction, cfg.schedule), 3, omega=0.8,
                   clip_norm=cfg.grad_clip, refresh_every=2, refresh_from="displacement")
    params = {"w": jnp.ones((16, 24)), "b": jnp.zeros((24,))}
    s_built, s_direct = built.init(params), direct.init(params)
    for step in range(3):
        grads = _grads(jax.random.key(step), params)
        u_built, s_built = built.update(grads, s_built, params)
        u_direct, s_direct = direct.update(grads, s_direct, params)
        for a, b in zip(jax.tree.leaves(u_built), jax.tree.leaves(u_direct)):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="lordo"):
        OptimizerConfig(name="lordoo")
