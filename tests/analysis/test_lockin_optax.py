"""The optax lock-in probe (lockin_probes spec §2, §3.1, §5): identity, known answers, and
agreement with the host-side LockinMonitor."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax.analysis import (
    LockinMonitor,
    LockinProbeState,
    curvature_basis,
    lockin_probe,
    probe_metrics,
    sharp_fraction,
)


def _run(tx, updates_seq, params0):
    """Feed a sequence of update trees through a jitted ``tx``; return the readout per step."""
    state = tx.init(params0)
    step = jax.jit(tx.update)
    out = []
    for updates in updates_seq:
        new_updates, state = step(updates, state)
        jax.tree.map(np.testing.assert_array_equal, new_updates, updates)
        out.append(probe_metrics(state))
    return out, state


def _increments(params_seq, params0):
    prev, incs = params0, []
    for p in params_seq:
        incs.append(jax.tree.map(lambda a, b: a - b, p, prev))
        prev = p
    return incs


def _rank_k(rng, shape, k):
    return rng.normal(size=(shape[0], k)) @ rng.normal(size=(k, shape[1]))


def _rotation(d, angle):
    """Rotation by ``angle`` in the planes (0, d-1), (1, d-2), ... of R^d."""
    r = np.eye(d)
    for i in range(d // 2):
        j = d - 1 - i
        c, s = np.cos(angle), np.sin(angle)
        r[[i, i, j, j], [i, j, i, j]] = [c, -s, s, c]
    return r


def _spd(rng, d):
    x = rng.normal(size=(3 * d, d)) * rng.uniform(0.2, 3.0, size=d)
    return x.T @ x / (3 * d) + 0.05 * np.eye(d)


def test_identity_on_updates_under_jit():
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
                        "bias": jnp.zeros(4)},
              "out": {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}}
    x = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)

    def loss(p):
        h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
        return jnp.sum(jnp.square(h @ p["out"]["kernel"] - 1.0))

    def trainer(tx):
        @jax.jit
        def step(p, s):
            updates, s = tx.update(jax.grad(loss)(p), s, p)
            return optax.apply_updates(p, updates), s, updates
        return step

    plain, probed = optax.adam(1e-2), optax.chain(optax.adam(1e-2), lockin_probe(k=2, every=2))
    p_a, s_a, step_a = params, plain.init(params), trainer(plain)
    p_b, s_b, step_b = params, probed.init(params), trainer(probed)
    for _ in range(5):
        p_a, s_a, u_a = step_a(p_a, s_a)
        p_b, s_b, u_b = step_b(p_b, s_b)
        jax.tree.map(np.testing.assert_array_equal, u_a, u_b)
        jax.tree.map(np.testing.assert_array_equal, p_a, p_b)
    m = probe_metrics(s_b)  # found inside the chain state
    assert m["step"] == 4 and set(m["per_layer"]) == {"dense/kernel", "out/kernel"}
    assert all(np.isfinite(v) for rec in m["per_layer"].values() for v in rec.values())
    # ΔW is the running sum of the applied updates = W_t − W_0.
    delta = s_b[1].leaves["out/kernel"].delta
    np.testing.assert_allclose(delta, p_b["out"]["kernel"] - params["out"]["kernel"], atol=1e-6)


def test_rank_metrics_known_answers():
    rng = np.random.default_rng(1)
    rank_one = np.outer(rng.normal(size=7), rng.normal(size=5)).astype(np.float32)
    q, _ = np.linalg.qr(rng.normal(size=(7, 3)))
    equal_sigma = (2.5 * q @ np.linalg.qr(rng.normal(size=(5, 3)))[0].T).astype(np.float32)
    params0 = {"one": jnp.zeros((7, 5)), "flat": jnp.zeros((7, 5))}
    (m,), _ = _run(lockin_probe(k=3, every=1),
                   [{"one": jnp.asarray(rank_one), "flat": jnp.asarray(equal_sigma)}], params0)
    one, flat = m["per_layer"]["one"], m["per_layer"]["flat"]
    assert one["stable_rank"] == pytest.approx(1.0, abs=1e-5)
    assert one["effective_rank"] == pytest.approx(1.0, abs=1e-5)
    assert one["norm"] == pytest.approx(np.linalg.norm(rank_one), rel=1e-6)
    assert flat["stable_rank"] == pytest.approx(3.0, abs=1e-5)
    assert flat["effective_rank"] == pytest.approx(3.0, abs=1e-5)
    assert m["drift"] is None and one["drift"] is None and m["t_lock"] is None


def _monitor_agreement(params_seq, params0, curvatures, *, k, lock_tol, lock_patience):
    mon = LockinMonitor(params0, curvatures, k=k, lock_tol=lock_tol,
                        lock_patience=lock_patience)
    tx = lockin_probe(k=k, every=1, lock_tol=lock_tol, lock_patience=lock_patience,
                      curvatures=curvatures)
    ours, _ = _run(tx, _increments(params_seq, params0), params0)
    for t, (params, got) in enumerate(zip(params_seq, ours), start=1):
        ref = mon.update(params, step=t)
        assert got["step"] == t and got["t_lock"] == ref["t_lock"]
        if t > 1:
            assert got["drift"] == pytest.approx(ref["drift"], abs=1e-5)
        if curvatures:
            assert got["harm"] == pytest.approx(ref["harm"], rel=1e-5, abs=1e-8)
        for name, rec in ref["per_layer"].items():
            for key, value in rec.items():
                assert got["per_layer"][name][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (
                    t, name, key)
    return ours


def test_agrees_with_lockin_monitor():
    rng = np.random.default_rng(2)
    shapes = {"w1": (8, 6), "w2": (6, 5)}
    with jax.enable_x64(True):
        params0 = {n: jnp.asarray(rng.normal(size=s)) for n, s in shapes.items()}
        fixed = {n: _rank_k(rng, s, 3) for n, s in shapes.items()}
        curvatures = {"w1": (jnp.asarray(_spd(rng, 8)), jnp.asarray(_spd(rng, 6)))}
        growing = [{n: params0[n] + (0.5 * t) * fixed[n] + 0.02 * rng.normal(size=shapes[n])
                    for n in shapes} for t in range(1, 9)]
        got = _monitor_agreement(growing, params0, curvatures, k=3, lock_tol=0.1,
                                 lock_patience=3)
        assert got[-1]["t_lock"] == 4  # calm from the 2nd probe on
        rotating = [{n: params0[n] + t * _rotation(shapes[n][0], 0.4 * t) @ fixed[n]
                     for n in shapes} for t in range(1, 9)]
        got = _monitor_agreement(rotating, params0, curvatures, k=3, lock_tol=0.1,
                                 lock_patience=3)
        assert got[-1]["t_lock"] is None


@pytest.mark.parametrize("every", [1, 2])
def test_lock_in_for_growing_fixed_subspace(every):
    rng = np.random.default_rng(3)
    fixed = jnp.asarray(_rank_k(rng, (9, 6), 2), jnp.float32)
    params0 = {"w": jnp.zeros((9, 6))}
    coeffs = np.linspace(0.1, 1.0, 4 * every + 2) ** 2  # ΔW_t = c_t · fixed, c_t growing
    updates = [{"w": jnp.asarray(c1 - c0, jnp.float32) * fixed}
               for c0, c1 in zip(np.r_[0.0, coeffs[:-1]], coeffs)]
    got, _ = _run(lockin_probe(k=2, every=every, lock_patience=3), updates, params0)
    probes = [m for t, m in enumerate(got, start=1) if t % every == 0]
    assert all(m["drift"] < 1e-5 for m in probes[1:])
    assert all(m["per_layer"]["w"]["capture"] == pytest.approx(1.0, abs=1e-5) for m in probes[1:])
    # Calm from the 2nd probe on, so the 3rd calm probe is the 4th probe.
    assert got[-1]["t_lock"] == 4 * every
    assert [m["t_lock"] for m in got[: 4 * every - 1]] == [None] * (4 * every - 1)


def test_no_lock_in_when_rotating_or_not_growing():
    rng = np.random.default_rng(4)
    fixed = _rank_k(rng, (8, 5), 2)
    params0 = {"w": jnp.zeros((8, 5))}
    rotating = [{"w": jnp.asarray(t * _rotation(8, 0.3 * t) @ fixed, jnp.float32)}
                for t in range(1, 13)]
    got, _ = _run(lockin_probe(k=2, every=1, lock_patience=3),
                  _increments(rotating, params0), params0)
    assert all(m["drift"] > 0.1 for m in got[1:])
    assert got[-1]["t_lock"] is None and got[-1]["calm"] == 0
    # A fixed subspace that stops growing (zero updates) is not lock-in either.
    stalled = [{"w": jnp.asarray(fixed, jnp.float32)}] + [{"w": jnp.zeros((8, 5))}] * 6
    got, _ = _run(lockin_probe(k=2, every=1, lock_patience=3), stalled, params0)
    assert got[-1]["drift"] < 1e-5 and got[-1]["t_lock"] is None and got[-1]["calm"] == 0


def test_curvature_metrics_match_hand_computation_and_probes():
    rng = np.random.default_rng(5)
    d_in, d_out = 6, 4
    a, g = _spd(rng, d_in), _spd(rng, d_out)
    curvatures = {"layer/kernel": (jnp.asarray(a, jnp.float32), jnp.asarray(g, jnp.float32))}
    params0 = {"layer": {"kernel": jnp.zeros((d_in, d_out)), "bias": jnp.zeros(d_out)}}
    steps = [rng.normal(size=(d_in, d_out)).astype(np.float32) for _ in range(3)]
    updates = [{"layer": {"kernel": jnp.asarray(s), "bias": jnp.ones(d_out)}} for s in steps]
    tx = lockin_probe(k=2, every=3, curvatures=curvatures, energy=0.8)
    got, _ = _run(tx, updates, params0)
    delta = np.sum(np.asarray(steps, np.float64), axis=0)
    harm = 0.5 * np.trace(a @ delta @ g @ delta.T)
    rec = got[-1]["per_layer"]["layer/kernel"]
    assert got[-1]["harm"] == pytest.approx(harm, rel=1e-5)
    assert rec["harm"] == pytest.approx(harm, rel=1e-5)
    basis = curvature_basis(curvatures["layer/kernel"], energy=0.8)
    ref = sharp_fraction(jnp.asarray(delta, jnp.float32), basis)
    assert 0.0 < rec["phi"] < 1.0
    assert rec["phi"] == pytest.approx(ref["phi"], rel=1e-5)
    assert rec["phi_iso"] == pytest.approx(ref["phi_iso"], rel=1e-6)
    assert rec["channelling"] == pytest.approx(ref["channelling"], rel=1e-5)
    # First probe: the step since the last probe is the whole ΔW.
    assert rec["phi_step"] == pytest.approx(rec["phi"], rel=1e-5)
    assert got[0]["harm"] is None and got[0]["step"] is None


def test_nested_dicts_where_and_every():
    rng = np.random.default_rng(6)
    params0 = {"layers": {"0": {"kernel": jnp.zeros((5, 4)), "bias": jnp.zeros(4)},
                          "1": {"kernel": jnp.zeros((4, 4)), "bias": jnp.zeros(4)}},
               "embed": {"embedding": jnp.zeros((10, 5))}}
    tx = lockin_probe(k=2, every=3, where=lambda path, leaf: path.endswith("kernel"))
    updates = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32),
                            params0) for _ in range(7)]
    got, state = _run(tx, updates, params0)
    assert set(state.leaves) == {"layers/0/kernel", "layers/1/kernel"}
    assert [m["step"] for m in got] == [None, None, 3, 3, 3, 6, 6]
    assert got[3] == got[2] and got[4] == got[2] and got[6] == got[5]
    assert got[5]["per_layer"] != got[2]["per_layer"]
    delta = sum(np.asarray(u["layers"]["0"]["kernel"], np.float64) for u in updates[:6])
    assert got[5]["per_layer"]["layers/0/kernel"]["norm"] == pytest.approx(
        np.linalg.norm(delta), rel=1e-5)
    assert int(state.count) == 7 and isinstance(state, LockinProbeState)


def test_bad_arguments_raise_clear_errors():
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    with pytest.raises(ValueError, match="not probed leaves"):
        lockin_probe(curvatures={"nope": (jnp.eye(3), jnp.eye(2))}).init(params)
    with pytest.raises(ValueError, match="needs A"):
        lockin_probe(curvatures={"w": (jnp.eye(2), jnp.eye(2))}).init(params)
    with pytest.raises(ValueError, match="only 2-D"):
        lockin_probe(where=lambda path, leaf: True).init(params)
    with pytest.raises(ValueError, match="every"):
        lockin_probe(every=0)
    with pytest.raises(ValueError, match="found 0"):
        probe_metrics(optax.adam(1e-3).init(params))


def test_inside_nnx_optimizer():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = Mlp(nnx.Rngs(0))
    w0 = model.l1.kernel[...]
    opt = nnx.Optimizer(model, optax.chain(optax.adam(1e-2), lockin_probe(k=2, every=2)),
                        wrt=nnx.Param)
    x = jnp.ones((3, 4))

    @nnx.jit
    def train_step(model, opt):
        opt.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))

    for _ in range(4):
        train_step(model, opt)
    m = probe_metrics(opt.opt_state)
    assert m["step"] == 4 and set(m["per_layer"]) == {"l1/kernel", "l2/kernel"}
    assert m["per_layer"]["l1/kernel"]["norm"] == pytest.approx(
        float(jnp.linalg.norm(model.l1.kernel[...] - w0)), rel=1e-5)
