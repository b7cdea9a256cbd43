"""BaLoRA: product kept, balanced, idempotent, zero product untouched, jit / 8-device mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lowrank_jax.nn import LoRALinear
from lowrank_jax.optim.balora import (
    balance_lora_params,
    balance_pair,
    balancing_gap,
    balora,
    find_pairs,
    scale_by_balora,
)


def _pair(seed, p=12, r=3, q=9, deficient=False):
    k1, k2 = jax.random.split(jax.random.key(seed))
    left = jax.random.normal(k1, (p, r))
    right = jax.random.normal(k2, (r, q))
    if deficient:
        left = left.at[:, -1].set(0.0)
    return left, right


def _rel(x, ref):
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize("mode", ["svd", "procrustes"])
@pytest.mark.parametrize("deficient", [False, True])
def test_product_kept_and_balanced(mode, deficient):
    left, right = _pair(0, deficient=deficient)
    new_l, new_r = balance_pair(left, right, mode=mode)
    assert _rel(new_l @ new_r, left @ right) <= 1e-5
    gap = balancing_gap(new_l, new_r) / jnp.linalg.norm(left @ right)
    assert float(gap) <= 1e-5


def test_svd_mode_gram_is_singular_values():
    left, right = _pair(1)
    new_l, _ = balance_pair(left, right, mode="svd")
    sigma = jnp.linalg.svd(left @ right, compute_uv=False)[:3]
    np.testing.assert_allclose(new_l.T @ new_l, jnp.diag(sigma), atol=1e-4 * float(sigma[0]))


def test_procrustes_idempotent_and_closest():
    left, right = _pair(2)
    once = balance_pair(left, right, mode="procrustes")
    twice = balance_pair(*once, mode="procrustes")
    assert _rel(twice[0], once[0]) <= 1e-5 and _rel(twice[1], once[1]) <= 1e-5
    svd = balance_pair(left, right, mode="svd")

    def dist(pair):
        return float(jnp.sum((pair[0] - left) ** 2) + jnp.sum((pair[1] - right) ** 2))

    assert dist(once) <= dist(svd) + 1e-6


def test_svd_gauge_invariant_up_to_signs():
    left, right = _pair(3)
    g = jax.random.normal(jax.random.key(9), (3, 3)) + 3 * jnp.eye(3)
    a = balance_pair(left, right, mode="svd")[0]
    b = balance_pair(left @ g, jnp.linalg.solve(g, right), mode="svd")[0]
    np.testing.assert_allclose(jnp.abs(a), jnp.abs(b), atol=1e-4)


@pytest.mark.parametrize("mode", ["svd", "procrustes"])
def test_zero_product_untouched(mode):
    left = jax.random.normal(jax.random.key(0), (8, 2))
    right = jnp.zeros((2, 5))
    new_l, new_r = balance_pair(left, right, mode=mode)
    np.testing.assert_array_equal(new_l, left)
    np.testing.assert_array_equal(new_r, right)
    assert not np.isnan(np.asarray(new_l)).any()


def test_find_pairs_half_pair_and_masked_node():
    tree = {"q": {"lora_a": jnp.ones((4, 2)), "lora_b": jnp.ones((2, 3))},
            "k": {"lora_a": optax.MaskedNode(), "kernel": jnp.ones(2)}}
    assert find_pairs(tree, kinds=("lora",)) == [(("q", "lora_a"), ("q", "lora_b"))]
    with pytest.raises(ValueError, match="lora_b"):
        find_pairs({"q": {"lora_a": jnp.ones((4, 2))}}, kinds=("lora",))


def _params():
    left, right = _pair(4, p=16, r=2, q=8)
    return {"attn": {"lora_a": left, "lora_b": right}, "head": jnp.ones((8,)),
            "fresh": {"lora_a": left, "lora_b": jnp.zeros((2, 8))}}


def test_chain_matches_balance_of_adam_step_and_passes_other_leaves():
    params = _params()
    grads = jax.tree.map(lambda x: jnp.cos(jnp.arange(x.size, dtype=x.dtype)).reshape(x.shape),
                         params)
    adam = optax.adamw(1e-2, weight_decay=0.01)
    plain, _ = adam.update(grads, adam.init(params), params)
    tx = balora(adam)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    want = balance_lora_params(optax.apply_updates(params, plain))
    for got, ref in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, atol=1e-6)
    np.testing.assert_allclose(updates["head"], plain["head"], atol=0)
    # the adapter whose product stays zero-free after the step is balanced, and is never killed
    assert float(jnp.abs(new["fresh"]["lora_b"]).max()) > 0


def test_every_and_start_step():
    params = _params()
    grads = jax.tree.map(jnp.ones_like, params)
    tx = optax.chain(optax.sgd(1e-2), scale_by_balora(every=2, start_step=1))
    state = tx.init(params)
    plain = optax.sgd(1e-2).update(grads, optax.sgd(1e-2).init(params))[0]
    projected = []
    for _ in range(4):
        updates, state = tx.update(grads, state, params)
        projected.append(not np.allclose(updates["attn"]["lora_a"], plain["attn"]["lora_a"]))
    assert projected == [False, False, True, False]


def test_jit_equals_eager_and_state_types_kept():
    params = _params()
    grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
    tx = balora(optax.adam(1e-2))
    state = tx.init(params)
    eager, _ = tx.update(grads, state, params)
    jitted, new_state = jax.jit(tx.update)(grads, state, params)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert jax.tree.map(jax.typeof, state) == jax.tree.map(jax.typeof, new_state)


def test_eight_device_mesh():
    mesh = jax.make_mesh((8,), ("x",))
    params = _params()
    grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
    tx = balora(optax.adam(1e-2))
    reference, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    shard = {"attn": {"lora_a": P("x", None), "lora_b": P(None, "x")}, "head": P("x"),
             "fresh": {"lora_a": P("x", None), "lora_b": P(None, "x")}}
    with jax.set_mesh(mesh):
        put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                     t, shard)
        sp, sg = put(params), put(grads)
        state = tx.init(sp)
        updates, new_state = jax.jit(tx.update)(sg, state, sp)
        assert jax.tree.map(jax.typeof, state) == jax.tree.map(jax.typeof, new_state)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_nnx_optimizer_wrt_lora_param():
    layer = LoRALinear(8, 6, rank=2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(layer, balora(optax.adam(1e-2)), wrt=nnx.LoRAParam)
    x = jax.random.normal(jax.random.key(1), (5, 8))
    kernel = layer.kernel[...]

    @nnx.jit
    def step(layer, optimizer):
        grads = nnx.grad(lambda m: jnp.sum((m(x) - 1.0) ** 2), argnums=nnx.DiffState(
            0, nnx.LoRAParam))(layer)
        optimizer.update(layer, grads)

    for _ in range(3):
        step(layer, optimizer)
    a, b = layer.lora_a[...], layer.lora_b[...]
    assert float(balancing_gap(a, b) / jnp.linalg.norm(a @ b)) <= 1e-5
    np.testing.assert_array_equal(layer.kernel[...], kernel)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_arguments():
    with pytest.raises(ValueError, match="every"):
        scale_by_balora(every=0)
    with pytest.raises(ValueError, match="mode"):
        balance_pair(jnp.ones((3, 2)), jnp.ones((2, 3)), mode="qr")
    tx = scale_by_balora()
    with pytest.raises(ValueError, match="params"):
        tx.update({"lora_a": jnp.ones((3, 2))}, tx.init(None))


def test_relative_balancing_gap_known_values():
    from lowrank_jax.optim.balora import relative_balancing_gap

    a, b = jnp.diag(jnp.array([2.0, 1.0])), jnp.eye(2)  # AᵀA − BBᵀ = diag(3, 0), AB = diag(2, 1)
    tree = {"q": {"lora_a": a, "lora_b": b}, "v": {"lora_a": jnp.eye(2), "lora_b": jnp.eye(2)}}
    np.testing.assert_allclose(relative_balancing_gap(tree), (3.0 / np.sqrt(5.0) + 0.0) / 2,
                               rtol=1e-6)
