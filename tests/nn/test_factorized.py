"""FactorizedLinear: forward never forms W, full rank fits any matrix, inits are balanced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.nn import FactorizedLinear, LowRankFactor


def test_full_rank_fits_any_dense_matrix():
    w = jax.random.normal(jax.random.key(0), (12, 7))
    layer = FactorizedLinear.from_dense(w, rank=7)
    np.testing.assert_allclose(layer.dense_matrix(), w, atol=1e-5)
    x = jax.random.normal(jax.random.key(1), (3, 12))
    np.testing.assert_allclose(layer(x), x @ w, atol=1e-5)


def test_truncation_is_best_low_rank_approximation():
    w = jax.random.normal(jax.random.key(0), (16, 10))
    layer = FactorizedLinear.from_dense(w, rank=3)
    s = np.linalg.svd(np.asarray(w), compute_uv=False)
    err = np.linalg.norm(np.asarray(layer.dense_matrix() - w), 2)
    np.testing.assert_allclose(err, s[3], rtol=1e-4)  # Eckart–Young


@pytest.mark.parametrize("init", ["svd_of_dense", "orthogonal"])
def test_init_is_balanced_and_typed(init):
    layer = FactorizedLinear(32, 24, 8, init=init, rngs=nnx.Rngs(0))
    a, b = layer.a[...], layer.b[...]
    assert a.shape == (32, 8) and b.shape == (8, 24)
    np.testing.assert_allclose(np.linalg.norm(a, 2), np.linalg.norm(b, 2), rtol=1e-4)
    factors = nnx.state(layer, LowRankFactor)
    assert {k for k, _ in nnx.to_flat_state(factors)} == {("a",), ("b",)}
    assert layer.a.role == "a" and layer.b.role == "b"


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_rank_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rank=9 is invalid for a \[8, 16\] weight"):
        FactorizedLinear(8, 16, 9, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown init"):
        FactorizedLinear(8, 16, 2, init="svd", rngs=nnx.Rngs(0))


def test_forward_under_jit_matches_eager():
    layer = FactorizedLinear(16, 8, 4, use_bias=True, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 16))
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), layer(x), atol=1e-6)
