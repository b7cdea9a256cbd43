"""The existing LoRALinear / apply_lora: init equals the dense layer, merge/unmerge, injection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.nn import LoRALinear, LoRARule, apply_lora, lora_layers, merge_lora, unmerge_lora

CFG = LlamaConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32)
TOKENS = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) % 64


def test_lora_linear_at_init_equals_dense():
    dense = nnx.Linear(8, 5, rngs=nnx.Rngs(0))
    dense.bias[...] = jnp.arange(5.0)
    layer = LoRALinear.from_linear(dense, rank=2, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (3, 8))
    np.testing.assert_array_equal(layer(x), dense(x))


def test_merge_then_unmerge_restores_weights():
    layer = LoRALinear(8, 5, rank=2, alpha=4.0, rngs=nnx.Rngs(0))
    layer.lora_b[...] = jax.random.normal(jax.random.key(1), (2, 5))
    kernel = layer.kernel[...]
    x = jax.random.normal(jax.random.key(2), (3, 8))
    out = layer(x)
    layer.merge()
    np.testing.assert_allclose(layer(x), out, atol=1e-5)
    np.testing.assert_allclose(layer.kernel[...], kernel + 2.0 * layer.lora_a[...] @
                               layer.lora_b[...], atol=1e-6)
    layer.unmerge()
    np.testing.assert_allclose(layer.kernel[...], kernel, atol=1e-6)
    with pytest.raises(ValueError, match="not merged"):
        layer.unmerge()


def test_apply_lora_changes_only_matched_layers_and_keeps_output():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    before, _ = model(TOKENS)
    adapted = apply_lora(model, [LoRARule(r"self_attn/(q|v)_proj", rank=2)], rngs=nnx.Rngs(1))
    assert adapted == ["layers/0/self_attn/q_proj", "layers/0/self_attn/v_proj",
                       "layers/1/self_attn/q_proj", "layers/1/self_attn/v_proj"]
    assert [p for p, _ in lora_layers(model)] == adapted
    assert type(model.layers[0].self_attn.k_proj) is nnx.Linear
    assert type(model.layers[0].mlp.up_proj) is nnx.Linear
    after, _ = model(TOKENS)
    np.testing.assert_array_equal(after, before)


def test_apply_lora_per_path_ranks_and_merge_all():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, "mlp/up_proj", rngs=nnx.Rngs(1), ranks={"layers/1/mlp/up_proj": 3})
    assert model.layers[0].mlp.up_proj.rank == 8 and model.layers[1].mlp.up_proj.rank == 3
    for _, m in lora_layers(model):
        m.lora_b[...] = 0.1 * jnp.ones_like(m.lora_b[...])
    out, _ = model(TOKENS)
    assert merge_lora(model) == 2
    merged, _ = model(TOKENS)
    np.testing.assert_allclose(merged, out, atol=1e-4)
    assert unmerge_lora(model) == 2


def test_unknown_rule_lists_paths():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Available layer paths: .*layers/0/self_attn/q_proj"):
        apply_lora(model, LoRARule("query", rank=2), rngs=nnx.Rngs(1))
