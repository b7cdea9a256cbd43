"""The weight-space step size Spectron bounds: known answers on factor pairs and kernels."""

import jax.numpy as jnp
import numpy as np

from lowrank_jax.optim import find_pairs, max_update_norm


def test_factorized_update_norm_is_the_spectral_norm_of_the_product_change():
    old = {"p": {"a": jnp.eye(4, 2), "b": jnp.eye(2, 3)},
           "q": {"a": jnp.ones((3, 1)), "b": jnp.ones((1, 2))}}
    new = {"p": {"a": jnp.eye(4, 2) * jnp.array([3.0, 1.0]), "b": jnp.eye(2, 3)},  # σ = 2
           "q": {"a": 1.5 * jnp.ones((3, 1)), "b": jnp.ones((1, 2))}}  # 0.5·‖1 1ᵀ‖ = 0.5·√6
    want = [(("p", "a"), ("p", "b")), (("q", "a"), ("q", "b"))]
    assert find_pairs(old, kinds=("factor",)) == want  # the weights max_update_norm reads
    np.testing.assert_allclose(float(max_update_norm(old)(old, new)), 2.0,
                               rtol=1e-5)


def test_dense_update_norm_reads_the_layer_kernels():
    old = {"layers": {"0": {"kernel": jnp.zeros((3, 3))}}, "embed": jnp.zeros((5, 3))}
    new = {"layers": {"0": {"kernel": jnp.diag(jnp.array([0.5, -4.0, 1.0]))}},
           "embed": 100 * jnp.ones((5, 3))}  # not a layer kernel: not measured
    np.testing.assert_allclose(float(max_update_norm(old)(old, new)), 4.0,
                               rtol=1e-5)
