"""MultiLoRALinear: per-example adapters, padded rank slots, equivalence with single LoRA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.nn.lora import LoRALinear
from lowrank_jax.nn.multi_lora import MultiLoRALinear, apply_multi_lora, set_adapter_ids

RANKS = (1, 3, 5)


def _layer(implementation="ragged"):
    layer = MultiLoRALinear(12, 7, ranks=RANKS, alphas=(2.0, 3.0, 10.0), rank_pad=4,
                            implementation=implementation, rngs=nnx.Rngs(0))
    b = jax.random.normal(jax.random.key(1), layer.lora_b[...].shape)
    layer.lora_b[...] = b * layer.rank_mask()[:, :, None]
    return layer


def test_matches_single_lora_per_example():
    layer = _layer()
    x = jax.random.normal(jax.random.key(2), (4, 3, 12))
    ids = jnp.array([2, 0, 2, 1])
    y = layer(x, ids)
    for k in range(len(RANKS)):
        single = LoRALinear(12, 7, rank=RANKS[k], alpha=layer.scales[k] * RANKS[k],
                            rngs=nnx.Rngs(5))
        single.kernel[...], single.bias[...] = layer.kernel[...], layer.bias[...]
        single.lora_a[...], single.lora_b[...] = layer.adapter(k)
        rows = np.flatnonzero(np.asarray(ids) == k)
        np.testing.assert_allclose(y[rows], single(x[rows]), rtol=1e-5, atol=1e-5)
    # the sorted ragged_dot layout and the per-example gather layout agree (the Pallas layout
    # shares the sort and is covered against ragged_dot in tests/pallas_kernels)
    np.testing.assert_allclose(_layer("gather")(x, ids), y, rtol=1e-5, atol=1e-5)


def test_padded_slots_get_exactly_zero_gradient():
    layer = _layer()
    assert layer.r_max == 8
    x = jax.random.normal(jax.random.key(3), (6, 12))
    ids = jnp.array([0, 1, 2, 2, 1, 0])
    graph, lora, rest = nnx.split(layer, nnx.LoRAParam, ...)
    # perturb padded slots: even nonzero padding must neither leak into y nor get a gradient
    lora["lora_a"].set_value(lora["lora_a"].get_value() + 1.0)

    def loss(lora):
        return jnp.sum(jnp.tanh(nnx.merge(graph, lora, rest)(x, ids)) ** 2)

    grads = jax.grad(loss)(lora)
    pad = np.asarray(layer.rank_mask()) == 0
    ga, gb = np.asarray(grads["lora_a"].get_value()), np.asarray(grads["lora_b"].get_value())
    assert np.all(ga.transpose(0, 2, 1)[pad] == 0.0) and np.all(gb[pad] == 0.0)
    assert np.abs(ga.transpose(0, 2, 1)[~pad]).sum() > 0 and np.abs(gb[~pad]).sum() > 0
    # only lora params are LoRAParam; the base kernel/bias keep nnx.Linear's names
    assert set(nnx.state(layer, nnx.LoRAParam).keys()) == {"lora_a", "lora_b"}
    assert {"kernel", "bias"} <= set(nnx.state(layer, nnx.Param).keys())


def test_zero_b_gives_base_output_and_groups_are_isolated():
    layer = _layer()
    x = jax.random.normal(jax.random.key(4), (3, 12))
    y = layer(x, jnp.array([0, 1, 2]))
    # changing adapter 1 leaves the rows of adapters 0 and 2 unchanged
    layer.lora_b[...] = layer.lora_b[...].at[1].multiply(5.0)
    y2 = layer(x, jnp.array([0, 1, 2]))
    np.testing.assert_array_equal(y[jnp.array([0, 2])], y2[jnp.array([0, 2])])
    layer.lora_b[...] = jnp.zeros_like(layer.lora_b[...])
    np.testing.assert_allclose(layer(x, jnp.array([0, 1, 2])), x @ layer.kernel[...] +
                               layer.bias[...], rtol=1e-6, atol=1e-6)


def test_apply_multi_lora_and_set_ids():
    class Block(nnx.Module):
        def __init__(self):
            self.up_proj = nnx.Linear(6, 6, rngs=nnx.Rngs(0))
            self.other = nnx.Linear(6, 6, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.other(self.up_proj(x))

    block = Block()
    x = jnp.ones((2, 6))
    before = block(x)
    assert apply_multi_lora(block, ranks=(2, 4), rngs=nnx.Rngs(2)) == 1
    assert isinstance(block.up_proj, MultiLoRALinear)
    set_adapter_ids(block, jnp.array([1, 0]))
    np.testing.assert_allclose(block(x), before, rtol=1e-6)  # B = 0 at init


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="ranks"):
        MultiLoRALinear(4, 4, ranks=(9,), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="alphas"):
        MultiLoRALinear(4, 4, ranks=(1, 2), alphas=(1.0,), rngs=nnx.Rngs(0))
    layer = MultiLoRALinear(4, 4, ranks=(1, 2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="adapter_ids"):
        layer(jnp.ones((3, 4)), jnp.array([0, 1]))
