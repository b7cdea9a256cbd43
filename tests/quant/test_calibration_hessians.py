"""Calibration Hessians of named projections equal E[x xᵀ] of their captured inputs, damped."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.quantize.pipeline import calibration_hessians


def test_hessian_of_the_first_layers_input_is_the_normed_embeddings_gram():
    cfg = LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 16, (5, 4)).astype(np.int32)
    h = calibration_hessians(model, tokens, ["layers/0/self_attn/q_proj"], damp=0.1,
                             batch_size=2)["layers/0/self_attn/q_proj"]
    layer = model.layers[0]
    x = layer.input_layernorm(model.embed_tokens(jnp.asarray(tokens))).reshape(-1, 8)
    gram = np.asarray(x.T @ x) / x.shape[0]
    want = gram + 0.1 * np.mean(np.diag(gram)) * np.eye(8)
    np.testing.assert_allclose(np.asarray(h), want, rtol=1e-4, atol=1e-6)
