"""Janus-LoRA: exact safety of rectified updates (also through Adam + clamp), descent, OE, DML."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.nn import LoRALinear
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    clamp_pair,
    decoupled_margin_loss,
    scale_by_janus,
    oe_accumulate,
    oe_finalize,
    orthogonality_clamp,
    orthonormalize_basis,
    reanchor,
    rectify_pair,
)

D, R, O, S = 24, 4, 16, 2.0


def problem(seed, k):
    keys = jax.random.split(jax.random.key(seed), 5)
    a = jax.random.normal(keys[0], (D, R))
    b = jax.random.normal(keys[1], (R, O))
    g_w = jax.random.normal(keys[2], (D, O))  # full-weight gradient
    basis = jnp.linalg.qr(jax.random.normal(keys[3], (D, max(k, 1))))[0][:, :k]
    return a, b, g_w, basis


def composite(da, db, a, b):
    return da @ b + a @ db


@pytest.mark.parametrize("k", [0, 2, 4, 9])
@pytest.mark.parametrize("precondition", [True, False])
def test_rectified_composite_and_finite_step_are_orthogonal(k, precondition):
    a, b, g_w, v = problem(k, k)
    g_a, g_b = S * g_w @ b.T, S * a.T @ g_w
    da, db = rectify_pair(g_a, g_b, a, b, v, scale=S, precondition=precondition)
    scale = float(jnp.linalg.norm(composite(da, db, a, b)))
    assert float(jnp.linalg.norm(v.T @ composite(da, db, a, b))) <= 1e-5 * max(scale, 1.0)
    eta = 0.3
    step = (a - eta * da) @ (b - eta * db) - a @ b
    assert float(jnp.linalg.norm(v.T @ step)) <= 1e-5 * max(float(jnp.linalg.norm(step)), 1.0)
    # descent: the composite has a non-negative inner product with the full gradient
    assert float(jnp.vdot(g_w, composite(da, db, a, b))) >= -1e-6


def test_plain_lora_gradient_leaks_and_empty_basis_is_identity():
    a, b, g_w, v = problem(1, 3)
    g_a, g_b = S * g_w @ b.T, S * a.T @ g_w
    leak = float(jnp.linalg.norm(v.T @ composite(g_a, g_b, a, b)))
    assert leak > 1e-2  # projecting nothing is not safe
    da, db = rectify_pair(g_a, g_b, a, b, jnp.zeros((D, 0)), precondition=False)
    np.testing.assert_allclose(da, g_a, atol=1e-6)
    np.testing.assert_allclose(db, g_b, atol=1e-6)


def test_adam_breaks_safety_and_clamp_restores_it():
    a, b, g_w, v = problem(3, 3)
    params = {"layer": {"lora_a": a, "lora_b": b}}
    grads = {"layer": {"lora_a": S * g_w @ b.T, "lora_b": S * a.T @ g_w}}
    subspaces = {"layer": v}

    def run(tx):
        state = tx.init(params)
        updates, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, subspaces=subspaces))(
            grads, state, params)
        new = optax.apply_updates(params, updates)
        delta = new["layer"]["lora_a"] @ new["layer"]["lora_b"] - a @ b
        return float(jnp.linalg.norm(v.T @ delta)) / float(jnp.linalg.norm(delta))

    unclamped = optax.chain(scale_by_janus(S), optax.scale_by_adam(),
                            optax.scale_by_learning_rate(0.1))
    clamped = optax.chain(scale_by_janus(S), optax.scale_by_adam(),
                          optax.scale_by_learning_rate(0.1), orthogonality_clamp())
    assert run(unclamped) > 1e-3
    assert run(clamped) <= 1e-5


def test_reanchor_preserves_function_and_zeroes_protected_part():
    layer = LoRALinear(D, O, rank=R, alpha=2 * R, rngs=nnx.Rngs(0))
    layer.lora_b[...] = jax.random.normal(jax.random.key(1), (R, O))
    _, _, _, v = problem(2, 5)
    x = jax.random.normal(jax.random.key(3), (7, D))
    before = layer(x)
    reanchor(layer, v)
    np.testing.assert_allclose(layer(x), before, atol=1e-5)
    np.testing.assert_allclose(v.T @ layer.lora_a[...], 0.0, atol=1e-6)


def test_online_estimation_recovers_planted_subspace():
    key = jax.random.key(0)
    planted = jnp.linalg.qr(jax.random.normal(key, (D, 5)))[0]
    memory = SubspaceMemory.empty(D)
    chunks = [jax.random.normal(jax.random.key(i), (40, 5)) @ planted.T for i in range(1, 4)]
    for chunk in chunks:
        memory = oe_accumulate(memory, chunk)
    x = jnp.concatenate(chunks)
    np.testing.assert_allclose(memory.covariance, x.T @ x, rtol=1e-4, atol=1e-3)
    memory = oe_finalize(memory, 1 - 1e-9)
    k = int(memory.rank)
    assert k == 5
    v = memory.basis[:, :k]
    np.testing.assert_allclose(v.T @ v, np.eye(k), atol=1e-5)
    residual = planted - v @ (v.T @ planted)
    assert float(jnp.sum(residual ** 2)) < 1e-6
    # a second task in a new direction adds columns orthogonal to the old ones
    extra = jnp.linalg.qr(jax.random.normal(jax.random.key(9), (D, 2)))[0]
    memory = oe_finalize(oe_accumulate(memory, jax.random.normal(key, (50, 2)) @ extra.T),
                         1 - 1e-9)
    assert int(memory.rank) == 7
    np.testing.assert_allclose(memory.basis[:, :5], v, atol=1e-5)


def test_higher_threshold_never_gives_fewer_columns():
    x = jax.random.normal(jax.random.key(0), (200, D)) * jnp.linspace(3, 0.1, D)
    ranks = [int(oe_finalize(oe_accumulate(SubspaceMemory.empty(D), x), t).rank)
             for t in (0.5, 0.8, 0.95, 0.999)]
    assert ranks == sorted(ranks) and ranks[0] < ranks[-1]


def test_basis_validation():
    a, b, g_w, _ = problem(0, 2)
    with pytest.raises(ValueError, match=r"input width is 24"):
        scale_by_janus(S).update({"l": {"lora_a": a, "lora_b": b}}, None,
                                {"l": {"lora_a": a, "lora_b": b}}, subspaces={"l": jnp.eye(5)})
    skewed = jnp.eye(D)[:, :3] + 0.1
    with pytest.warns(UserWarning, match="not orthonormal"):
        fixed = orthonormalize_basis(skewed)
    np.testing.assert_allclose(fixed.T @ fixed, np.eye(3), atol=1e-5)


def test_decoupled_margin_loss_known_values():
    f = jnp.array([[1.0, 0.0], [0.0, 2.0]])
    anchors = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    labels = jnp.array([0, 1])
    protos = jnp.array([[1.0, 1.0]])  # cos = 1/√2 with both features
    # sample 0: max old 0.7071 − own 1 + 0.2 = −0.093 → 0 ; sample 1: same → 0
    assert float(decoupled_margin_loss(f, labels, protos, anchors, margin=0.2)) == 0.0
    # margin 0.5: each sample 0.7071 − 1 + 0.5 = 0.2071
    np.testing.assert_allclose(decoupled_margin_loss(f, labels, protos, anchors, margin=0.5),
                               0.5 - 1 + 2 ** -0.5, rtol=1e-5)
    # invariant to feature rescaling
    np.testing.assert_allclose(decoupled_margin_loss(3 * f, labels, protos, anchors, margin=0.5),
                               decoupled_margin_loss(f, labels, protos, anchors, margin=0.5),
                               rtol=1e-6)


def test_clamp_pair_keeps_the_protected_outputs_exactly():
    keys = jax.random.split(jax.random.key(7), 5)
    v = jnp.linalg.qr(jax.random.normal(keys[0], (D, 3)))[0]
    a = jax.random.normal(keys[1], (D, R))
    b = jax.random.normal(keys[2], (R, O))
    da, db = clamp_pair(jax.random.normal(keys[3], (D, R)), jax.random.normal(keys[4], (R, O)),
                        a, v)
    x = jax.random.normal(keys[0], (5, 3)) @ v.T  # inputs inside span(V)
    np.testing.assert_allclose(np.asarray(x @ (a + da) @ (b + db)), np.asarray(x @ a @ b),
                               rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(v.T @ da).max()) < 1e-5
    # the same as the optax transform's clamp of one pair
    params = {"l": {"lora_a": a, "lora_b": b}}
    ups = {"l": {"lora_a": jax.random.normal(keys[3], (D, R)),
                 "lora_b": jax.random.normal(keys[4], (R, O))}}
    tx = orthogonality_clamp()
    got, _ = tx.update(ups, tx.init(params), params, subspaces={"l": v})
    np.testing.assert_array_equal(np.asarray(got["l"]["lora_a"]), np.asarray(da))
    np.testing.assert_array_equal(np.asarray(got["l"]["lora_b"]), np.asarray(db))
