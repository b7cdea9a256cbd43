"""The data-parallel simulations: DDP is the mean-gradient step; LoRDO on identical replicas
is the single-worker run (averaging equal displacements changes nothing)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.optim import lordo, outer_average, simulate_ddp, simulate_lordo

X = jax.random.normal(jax.random.key(0), (3, 5, 8))
Y = jax.random.normal(jax.random.key(1), (3, 5, 8))


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w["k"]) - y) ** 2)


def test_ddp_is_adam_on_the_mean_gradient():
    tx = optax.adam(1e-2)
    params = {"k": jnp.eye(8)}
    got, info = simulate_ddp(tx, params, _loss, lambda t: (X, Y), steps=2)
    ref, state = params, tx.init(params)
    for _ in range(2):
        grads = jax.tree.map(lambda g: jnp.mean(g, 0),
                             jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0))(ref, X, Y))
        updates, state = tx.update(grads, state, ref)
        ref = optax.apply_updates(ref, updates)
    np.testing.assert_allclose(got["k"], ref["k"], atol=1e-6)
    assert info == {"floats_per_worker": 2 * 64, "syncs": 2}


def test_lordo_on_identical_replicas_matches_one_worker():
    tx = lordo(1e-2, rank=2, min_dim_for_lowrank=4, first_projection="set")
    params = {"k": jnp.eye(8)}

    def run(workers):
        batches = lambda t: (jnp.stack([X[t % 3]] * workers), jnp.stack([Y[t % 3]] * workers))
        return simulate_lordo(tx, params, _loss, batches, steps=5, period=2,
                              outer=outer_average(), workers=workers)

    (one, info1), (three, info3) = run(1), run(3)
    np.testing.assert_allclose(three["k"], one["k"], atol=1e-5)
    assert info3["syncs"] == 3  # after steps 2, 4 and the last one
    assert info3["floats_per_worker"] == info1["floats_per_worker"] > 0
