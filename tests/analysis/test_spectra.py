"""Spectra, Diffract comparisons, orbax streaming and the lock-in probes (specs §6 / §5)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.analysis import (
    LockinMonitor,
    check_same_architecture,
    checkpoint_shapes,
    compare_checkpoints,
    compare_matrices,
    curvature_basis,
    harm_signal,
    iter_checkpoint_matrices,
    mp_spike_count,
    powerlaw_alpha,
    principal_angles,
    project_sharp,
    project_soft,
    save_params,
    sharp_fraction,
    singular_overlap,
    spectral_share,
    subspace_drift,
)


def _orthogonal(n, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return q


def test_spectral_share_rotation_rescale_and_range():
    w0 = np.random.default_rng(0).normal(size=(12, 8))
    rotated = _orthogonal(12, 1) @ w0 @ _orthogonal(8, 2).T
    assert float(spectral_share(jnp.asarray(w0), jnp.asarray(rotated))) < 1e-5
    assert float(spectral_share(jnp.asarray(w0), jnp.asarray(2.5 * w0))) == pytest.approx(1.0,
                                                                                       abs=1e-5)
    for seed in range(3):
        w1 = w0 + 0.3 * np.random.default_rng(10 + seed).normal(size=w0.shape)
        s = float(spectral_share(jnp.asarray(w0), jnp.asarray(w1)))
        assert 0.0 <= s <= 1.0 + 1e-6


def test_singular_overlap_identity_signs_and_noise_floor():
    u = jnp.asarray(_orthogonal(10, 3))
    np.testing.assert_allclose(np.asarray(singular_overlap(u, u)), np.eye(10), atol=1e-5)
    flips = jnp.asarray(np.sign(np.random.default_rng(4).normal(size=10)))
    np.testing.assert_allclose(np.asarray(singular_overlap(u, u * flips)), np.eye(10), atol=1e-5)
    d = 200
    means = [float(jnp.mean(jnp.diag(singular_overlap(jnp.asarray(_orthogonal(d, 5 + i)),
                                                       jnp.asarray(_orthogonal(d, 50 + i))))))
             for i in range(3)]
    assert np.mean(means) == pytest.approx(math.sqrt(2 / (math.pi * d)), rel=0.15)


def test_principal_angles_invariant_to_rotation_within_subspace():
    u = jnp.asarray(_orthogonal(8, 6)[:, :3])
    r = jnp.asarray(_orthogonal(3, 7))
    assert float(jnp.max(principal_angles(u, u @ r))) < 1e-3
    e = jnp.eye(8)
    np.testing.assert_allclose(np.asarray(principal_angles(e[:, :2], e[:, 2:4])), [np.pi / 2] * 2,
                               atol=1e-5)


def test_compare_matrices_pure_rotation_has_zero_share_and_low_overlap():
    rng = np.random.default_rng(8)
    w0 = (rng.normal(size=(20, 12)) * np.linspace(3, 0.5, 12)).astype(np.float32)
    rotated = (_orthogonal(20, 9) @ w0).astype(np.float32)
    rec = compare_matrices(jnp.asarray(w0), jnp.asarray(rotated), k=4)
    assert rec["spectral_share"] < 1e-4
    assert rec["relative_spectrum_change"] < 1e-5
    assert rec["right_diag_overlap"] > 0.99  # only the left vectors rotated
    assert rec["left_diag_overlap"] < 0.8


def test_powerlaw_alpha_on_pareto_samples_and_short_input():
    x = (1 - np.random.default_rng(11).random(1500)) ** (-1 / 2.0)  # density exponent 3
    assert powerlaw_alpha(x)["alpha"] == pytest.approx(3.0, abs=0.25)
    assert math.isnan(powerlaw_alpha(np.ones(10))["alpha"])


def test_mp_spikes_random_vs_planted():
    rng = np.random.default_rng(12)
    noise = rng.normal(size=(300, 100)).astype(np.float32)
    assert mp_spike_count(jnp.asarray(noise)) <= 1
    planted = noise + 8.0 * np.outer(rng.normal(size=300), rng.normal(size=100)) / 10
    assert mp_spike_count(jnp.asarray(planted.astype(np.float32))) >= 1


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_checkpoint_streaming_and_architecture_check(tmp_path):
    a = {"layers": {0: {"q": {"kernel": np.ones((4, 3), np.float32)}},
                    1: {"q": {"kernel": np.zeros((4, 3), np.float32)}}},
         "norm": {"weight": np.ones(3, np.float32)}}
    b = jax.tree.map(lambda x: x + 1.0, a)
    pa, pb = save_params(tmp_path / "a", a), save_params(tmp_path / "b", b)
    assert checkpoint_shapes(pa)["layers/1/q/kernel"][0] == (4, 3)
    got = list(iter_checkpoint_matrices(pa, r"layers/1/"))
    assert [(n, m.shape, float(m.sum())) for n, _, m in got] == [("layers/1/q/kernel", (4, 3), 0.0)]
    diffs = compare_checkpoints(pa, pb, lambda x, y: float((y - x).mean()))
    assert diffs == {"layers/0/q/kernel": 1.0, "layers/1/q/kernel": 1.0}
    c = {"layers": {0: {"q": {"kernel": np.ones((4, 5), np.float32)}}}}
    pc = save_params(tmp_path / "c", c)
    with pytest.raises(ValueError, match="different architectures"):
        compare_checkpoints(pa, pc, lambda x, y: 0.0)
    with pytest.raises(ValueError, match="different architectures"):
        check_same_architecture({"w": ((2, 2), "f")}, {"w": ((2, 3), "f")})


# ----- lock-in probes (lockin_probes spec, DERIVED) -----

def test_harm_signal_equals_exact_gauss_newton_for_one_softmax_layer():
    rng = np.random.default_rng(13)
    d_in, d_out = 4, 3
    x = jnp.asarray(rng.normal(size=d_in), jnp.float32)
    w0 = jnp.asarray(rng.normal(size=(d_in, d_out)), jnp.float32)
    dw = 1e-2 * jnp.asarray(rng.normal(size=(d_in, d_out)), jnp.float32)
    p0 = jax.nn.softmax(x @ w0)

    def kl(w):
        logp = jax.nn.log_softmax(x @ w)
        return jnp.sum(p0 * (jnp.log(p0) - logp))

    hess = jax.hessian(kl)(w0).reshape(d_in * d_out, d_in * d_out)
    exact = 0.5 * dw.ravel() @ hess @ dw.ravel()
    a = jnp.outer(x, x)
    g = jnp.diag(p0) - jnp.outer(p0, p0)  # GNH of softmax cross-entropy w.r.t. logits
    h = harm_signal({"w": dw}, {"w": (a, g)})["total"]
    assert h == pytest.approx(float(exact), rel=1e-3)
    with pytest.raises(ValueError, match="no curvature"):
        harm_signal({"v": dw}, {"w": (a, g)})


def test_sharp_and_soft_projections_and_channelling():
    rng = np.random.default_rng(14)
    a = jnp.asarray(np.diag([100.0, 10.0, 1.0, 0.1]), jnp.float32)
    g = jnp.asarray(np.diag([5.0, 1.0, 0.2]), jnp.float32)
    basis = curvature_basis((a, g), energy=0.9)
    x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    assert sharp_fraction(project_sharp(x, basis), basis)["phi"] == pytest.approx(1.0, abs=1e-5)
    assert sharp_fraction(project_soft(x, basis), basis)["phi"] == pytest.approx(0.0, abs=1e-5)
    phis = [sharp_fraction(jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), basis)
            for _ in range(120)]
    assert np.mean([p["phi"] for p in phis]) == pytest.approx(phis[0]["phi_iso"], abs=0.05)


def test_lockin_monitor_fixed_subspace_locks_and_rotation_drifts():
    rng = np.random.default_rng(15)
    fixed = rng.normal(size=(8, 2)) @ rng.normal(size=(2, 6))
    mon = LockinMonitor({"w": np.zeros((8, 6))}, k=2, lock_tol=0.1, lock_patience=3)
    for t in range(1, 7):
        out = mon.update({"w": t * fixed}, step=t)
        if "drift" in out:
            assert out["drift"] < 1e-3
            assert out["per_layer"]["w"]["stable_rank"] <= 2.0 + 1e-5
    assert mon.t_lock == 4  # first drift at t=2; three calm probes: t = 2, 3, 4
    spin = LockinMonitor({"w": np.zeros((8, 6))}, k=2, lock_tol=0.1, lock_patience=2)
    for t in range(1, 6):
        w = rng.normal(size=(8, 2)) @ rng.normal(size=(2, 6)) * t
        out = spin.update({"w": w}, step=t)
    assert out["drift"] > 0.1 and spin.t_lock is None
    assert subspace_drift(jnp.eye(4)[:, :2], jnp.eye(4)[:, 2:]) == pytest.approx(1.0, abs=1e-5)
