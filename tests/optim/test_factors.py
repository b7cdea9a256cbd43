"""Tests for lowrank_jax.optim.factors: pair finding and labels."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.nn import FactorizedLinear
from lowrank_jax.optim import find_pairs, spectron_with_adamw

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("optim.test_factors")


class TwoFactorized(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.first = FactorizedLinear(8, 12, 3, rngs=rngs)
        self.second = FactorizedLinear(12, 8, 2, use_bias=True, rngs=rngs)

    def __call__(self, tokens):
        return self.second(jax.nn.relu(self.first(self.embed(tokens))))


@pytest.fixture(scope="module")
def model():
    # Shapes from an abstract model, values from NumPy: no eager SVD init (slow on a busy CPU).
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TwoFactorized(nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), state)
    return nnx.merge(graphdef, state)


def test_two_factorized_layers_and_embedding_give_two_pairs(model):
    want = [(("first", "a"), ("first", "b")), (("second", "a"), ("second", "b"))]
    assert find_pairs(nnx.state(model, nnx.Param), kinds=("factor",)) == want
    pure = nnx.as_pure(nnx.state(model, nnx.Param))  # the nnx.Optimizer form
    assert find_pairs(pure, kinds=("factor",)) == want
    labels = find_pairs(pure, kinds=("factor",), labels=("spectron", "adamw"))
    assert labels["first"]["a"] == "spectron" and labels["second"]["b"] == "spectron"
    assert labels["second"]["bias"] == "adamw" and labels["embed"]["embedding"] == "adamw"


def test_llama_factorized_has_seven_pairs_per_layer():
    cfg = LlamaConfig(d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32,
                      projection="factorized", vocab_size=32)
    # Abstract model (shapes only): pairing never looks at values.
    state = nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    pairs = find_pairs(state, kinds=("factor",))
    assert len(pairs) == 14
    assert (("layers", 0, "self_attn", "q_proj", "a"),
            ("layers", 0, "self_attn", "q_proj", "b")) in pairs
    dense_cfg = LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                            vocab_size=32)
    dense = nnx.eval_shape(lambda: Llama(dense_cfg, rngs=nnx.Rngs(0)))
    assert find_pairs(nnx.state(dense, nnx.Param), kinds=("factor",)) == []


def test_dict_pairs_and_masked_nodes_are_skipped():
    params = {"p": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}, "w": jnp.ones(3),
              "q": {"a": jnp.ones((3, 1)), "b": jnp.ones((1, 3))}}
    want = [(("p", "a"), ("p", "b")), (("q", "a"), ("q", "b"))]
    assert find_pairs(params, kinds=("factor",)) == want
    masked = {"p": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}, "w": optax.MaskedNode(),
              "q": {"a": optax.MaskedNode(), "b": optax.MaskedNode()}}
    assert find_pairs(masked, kinds=("factor",)) == [(("p", "a"), ("p", "b"))]


def test_half_pair_raises_with_path():
    with pytest.raises(ValueError, match="layer/a"):
        find_pairs({"layer": {"a": jnp.ones((4, 2)), "kernel": jnp.ones((4, 4))}},
                   kinds=("factor",))
    with pytest.raises(ValueError, match="top/b"):
        find_pairs({"top": {"b": jnp.ones((2, 4))}}, kinds=("factor",))


def test_partition_gives_non_factor_leaves_pure_adamw_updates(model):
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
    tx = spectron_with_adamw(0.05, 1e-2, weight_decay=0.1)
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    adamw = optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1)
    for path in (("embed", "embedding"), ("second", "bias")):
        leaf_p = params[path[0]][path[1]]
        leaf_u, _ = adamw.update(grads[path[0]][path[1]], adamw.init(leaf_p), leaf_p)
        np.testing.assert_allclose(updates[path[0]][path[1]], leaf_u, rtol=1e-6)
    # The factor updates are Spectron's, which AdamW's element-wise step is not.
    a_u = updates["first"]["a"]
    assert not np.allclose(np.abs(np.asarray(a_u)), 1e-2, rtol=1e-2)
