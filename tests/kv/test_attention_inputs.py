"""Attention inputs through the K/V provider extension point, and a model with another attention."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.attention import register_attention, unregister_attention
from lowrank_jax.kv.model import attention_inputs
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.models.llama import apply_rope, with_attention


def _model():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    return Llama(cfg, rngs=nnx.Rngs(0))


def test_first_layer_inputs_are_the_rotated_projections_of_the_normed_embeddings():
    model = _model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (1, 6)), jnp.int32)
    q, k, v = attention_inputs(model, tokens)
    assert q.shape == (2, 1, 6, 4, 4) and k.shape == v.shape == (2, 1, 6, 2, 4)
    layer = model.layers[0]
    q0, k0, v0 = layer.self_attn.qkv(layer.input_layernorm(model.embed_tokens(tokens)))
    positions = jnp.arange(6)[None, :]
    np.testing.assert_allclose(q[0], apply_rope(q0, positions, model.cfg.rope_theta), atol=1e-5)
    np.testing.assert_allclose(k[0], apply_rope(k0, positions, model.cfg.rope_theta), atol=1e-5)
    np.testing.assert_allclose(v[0], v0, atol=1e-5)


def test_with_attention_runs_the_named_implementation_and_leaves_the_model_alone():
    model = _model()
    tokens = jnp.zeros((1, 5), jnp.int32)
    register_attention("test_zero_attention", lambda q, k, v, **_: jnp.zeros_like(q))
    try:
        other = with_attention(model, ("reference", "test_zero_attention"))
        dense, _ = model(tokens)
        zeroed, _ = other(tokens)
        assert model.cfg.attention == "reference"
        assert not np.allclose(dense, zeroed)  # the second layer's attention is gone
        again, _ = with_attention(model, "reference")(tokens)
        np.testing.assert_allclose(again, dense, atol=1e-6)
    finally:
        unregister_attention("test_zero_attention")
