"""bf16 serving weights: exact bit round trip, same forward as a model with bf16-rounded weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.bf16 import Bf16Linear, bf16_weights, to_bf16_bits, widen_bf16_bits
from lowrank_jax.models.generate import generate, logits_full
from lowrank_jax.models.llama import Llama, LlamaConfig, projections


def tiny(**kw):
    cfg = LlamaConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                      max_seq_len=64, **kw)
    return Llama(cfg, rngs=nnx.Rngs(0))


def test_bits_widen_to_the_bf16_value_exactly():
    w = jax.random.normal(jax.random.key(0), (7, 5)) * 3
    widened = widen_bf16_bits(jnp.asarray(to_bf16_bits(w)))
    assert widened.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(widened),
                                  np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32)))


def test_served_model_equals_the_model_with_rounded_weights():
    model = tiny()
    served = bf16_weights(model)
    rounded = nnx.clone(model)
    for _, _, _, lin in projections(rounded):
        lin.kernel[...] = lin.kernel[...].astype(jnp.bfloat16).astype(jnp.float32)
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
    np.testing.assert_allclose(logits_full(served, tokens), logits_full(rounded, tokens),
                               rtol=1e-5, atol=1e-5)
    prompt = [3, 1, 4, 1, 5]
    assert (generate(served, None, prompt, max_new_tokens=6).token_ids
            == generate(rounded, None, prompt, max_new_tokens=6).token_ids)
    assert type(model.layers[0].mlp.up_proj) is nnx.Linear  # the input model is unchanged


@pytest.mark.no_typecheck
def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="uint16"):
        Bf16Linear(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="dtype='float32'"):
        bf16_weights(tiny(dtype="bfloat16", param_dtype="bfloat16"))
    with pytest.raises(ValueError, match="no dense nnx.Linear"):
        bf16_weights(tiny(projection="factorized"))
