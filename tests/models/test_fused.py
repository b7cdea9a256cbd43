"""fuse_projections: one matmul for q/k/v and gate/up gives the unfused model's outputs."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.bf16 import bf16_weights
from lowrank_jax.models.fused import FusedPart, fuse_projections
from lowrank_jax.models.generate import generate
from lowrank_jax.models.llama import Llama, LlamaConfig, count_params
from lowrank_jax.models.presets import preset_model
from lowrank_jax.nn import apply_lora

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("models.test_fused")

TOKENS = jnp.asarray([[5, 17, 2, 40, 9, 33, 1, 8]], jnp.int32)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                      max_seq_len=64)
    return Llama(cfg, rngs=nnx.Rngs(1))


def test_fused_model_has_the_logits_and_parameters_of_the_unfused(model):
    fused = fuse_projections(model)
    attn, mlp = fused.layers[1].self_attn, fused.layers[1].mlp
    assert all(isinstance(getattr(attn, n), FusedPart) for n in ("q_proj", "k_proj", "v_proj"))
    assert attn.q_proj.kernel is attn.v_proj.kernel and mlp.gate_proj.kernel is mlp.up_proj.kernel
    assert attn.q_proj.kernel[...].shape == (32, 32 + 16 + 16)
    assert count_params(fused) == count_params(model)  # the shared kernel is stored once
    np.testing.assert_allclose(fused(TOKENS)[0], model(TOKENS)[0], rtol=1e-5, atol=1e-5)
    x = jax.random.normal(jax.random.key(0), (1, 3, 32))
    for name in ("k_proj", "up_proj"):  # a part called alone is still that projection
        parent = "self_attn" if name == "k_proj" else "mlp"
        ref = getattr(getattr(model.layers[1], parent), name)(x)
        np.testing.assert_allclose(getattr(getattr(fused.layers[1], parent), name)(x), ref,
                                   rtol=1e-5, atol=1e-6)
    assert type(model.layers[0].self_attn.q_proj) is nnx.Linear  # the input is unchanged


def test_fused_generation_equals_the_unfused_path_on_tiny():
    """Greedy tokens and logits of the fast decode (unrolled layers, fused kernels) equal
    the previous path (scanned decode, separate projections) on the ``tiny`` preset."""
    tiny = preset_model("tiny")
    prompt = [72, 101, 108, 108, 111, 44, 32]
    old = generate(tiny, None, prompt, max_new_tokens=8, return_logits=True, stop_at_eos=False,
                   unroll_decode=False)
    new = generate(fuse_projections(tiny), None, prompt, max_new_tokens=8, return_logits=True,
                   stop_at_eos=False, unroll_decode=True)
    assert new.token_ids == old.token_ids and len(new.token_ids) == 8
    np.testing.assert_allclose(new.logits, old.logits, rtol=1e-4, atol=1e-4)


def test_fused_bf16_bits_equal_bf16_bits(model):
    served = bf16_weights(model)
    fused = fuse_projections(served)
    assert fused.layers[0].mlp.gate_proj.kernel[...].dtype == jnp.uint16
    np.testing.assert_allclose(fused(TOKENS)[0], served(TOKENS)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.no_typecheck
def test_groups_with_lora_stay_unfused_and_nothing_to_fuse_is_an_error(model):
    lora = nnx.clone(model)
    apply_lora(lora, {"q_proj|gate_proj": 2}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no q/k/v or gate/up group"):
        fuse_projections(lora)
    part_lora = nnx.clone(model)
    apply_lora(part_lora, {"q_proj": 2}, rngs=nnx.Rngs(0))
    fused = fuse_projections(part_lora)  # gate/up fused, q/k/v kept as they are
    assert isinstance(fused.layers[0].mlp.up_proj, FusedPart)
    assert not isinstance(fused.layers[0].self_attn.k_proj, FusedPart)
    np.testing.assert_allclose(fused(TOKENS)[0], part_lora(TOKENS)[0], rtol=1e-5, atol=1e-5)
    kernel = nnx.Param(jnp.zeros((4, 6)))
    with pytest.raises(ValueError, match="columns"):
        FusedPart(kernel, 4, 8)


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_fused_unrolled_decode_gives_the_previous_greedy_tokens(smollm2):
    smol, tok = smollm2
    prompt = tok.encode("The capital of France is")
    old = generate(smol, tok, prompt, max_new_tokens=6, stop_at_eos=False, unroll_decode=False)
    new = generate(fuse_projections(smol), tok, prompt, max_new_tokens=6, stop_at_eos=False,
                   unroll_decode=True)
    assert new.token_ids == old.token_ids and "Paris" in new.text
