"""GGUF files of the checkpoint families (qwen2, qwen3, gemma2, gemma3, phi3), written here the
way llama.cpp's converter writes them (no Q/K permutation for these NeoX-RoPE families, Gemma
norms stored as 1 + w, Phi-3's fused attn_qkv / ffn_up and its longrope factor tensors), load
with the logits of the model they were written from."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.families import config_from_hf
from lowrank_jax.models.gguf import load_gguf
from lowrank_jax.models.llama import Llama
from lowrank_jax.models.safetensors_io import state_dict_from_llama

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rms_norm_eps=1e-6, tie_word_embeddings=True)
CONFIGS = {  # what llama.cpp assumes: Gemma's scale 1/sqrt(head_dim), even layers slide, ...
    "qwen2": dict(model_type="qwen2", rope_theta=1e6),
    "qwen3": dict(model_type="qwen3", head_dim=12, rope_theta=1e6, tie_word_embeddings=False),
    "gemma2": dict(model_type="gemma2", head_dim=12, query_pre_attn_scalar=12, sliding_window=5,
                   attn_logit_softcapping=1.5, final_logit_softcapping=0.75),
    "gemma3": dict(model_type="gemma3_text", head_dim=12, query_pre_attn_scalar=12,
                   sliding_window=5, rope_theta=1e6, rope_local_base_freq=1e4,
                   rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "phi3": dict(model_type="phi3", sliding_window=7, original_max_position_embeddings=8,
                 partial_rotary_factor=0.5, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5],
                               "long_factor": [2.0, 3.0]}),
}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def family_model(arch: str) -> Llama:
    model = Llama(config_from_hf({**BASE, **CONFIGS[arch]}), rngs=nnx.Rngs(0))
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        value = var[...]
        var.set_value(value + 0.1 * jax.random.normal(jax.random.key(i), value.shape))
    return model


def write_family_gguf(model: Llama, arch: str, path) -> str:
    """llama.cpp's converter, written out independently of the loader."""
    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", cfg.n_layers), ("context_length", cfg.max_seq_len),
                       ("embedding_length", cfg.d_model), ("feed_forward_length", cfg.d_ff),
                       ("attention.head_count", cfg.n_heads),
                       ("attention.head_count_kv", cfg.n_kv_heads),
                       ("attention.key_length", cfg.head_dim), ("vocab_size", cfg.vocab_size),
                       ("rope.dimension_count", int(cfg.head_dim * cfg.partial_rotary_factor))):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.norm_eps)
    if cfg.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    for key, value in (("attn_logit_softcapping", cfg.attn_logit_softcap),
                       ("final_logit_softcapping", cfg.final_logit_softcap)):
        if value:
            w.add_float32(f"{arch}.{key}", value)
    if arch == "gemma3":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_scaling["factor"])
    tensors = state_dict_from_llama(model)
    if arch == "phi3":
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", cfg.original_max_seq_len)
        w.add_tensor("rope_factors_short.weight",
                     np.asarray(cfg.rope_scaling["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight",
                     np.asarray(cfg.rope_scaling["long_factor"], np.float32))
    for name, array in tensors.items():
        array = np.asarray(array, np.float32)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            if arch == "phi3" and part in ("self_attn.k_proj", "self_attn.v_proj",
                                           "mlp.up_proj"):
                continue  # written fused with q / gate below
            if arch == "phi3" and part == "self_attn.q_proj":
                array = np.concatenate([tensors[name], tensors[name.replace("q_proj", "k_proj")],
                                        tensors[name.replace("q_proj", "v_proj")]])
                out = f"blk.{index}.attn_qkv.{kind}"
            elif arch == "phi3" and part == "mlp.gate_proj":
                array = np.concatenate([tensors[name], tensors[name.replace("gate", "up")]])
                out = f"blk.{index}.ffn_up.{kind}"
            elif arch.startswith("gemma") and part in GEMMA_NORMS:
                out = f"blk.{index}.{GEMMA_NORMS[part]}.{kind}"
            else:
                out = f"blk.{index}.{LAYER[part]}.{kind}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1.0  # the converter's norm shift
        w.add_tensor(out, np.ascontiguousarray(array, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_family_gguf_loads_with_the_models_logits(arch, tmp_path):
    model = family_model(arch)
    loaded, _ = load_gguf(write_family_gguf(model, arch, tmp_path / f"{arch}.gguf"))
    for key in ("family", "qkv_bias", "qk_norm", "norm_offset", "sandwich_norms",
                "partial_rotary_factor", "attn_logit_softcap", "final_logit_softcap",
                "query_pre_attn_scalar", "rope_local_theta", "tie_embeddings"):
        assert getattr(loaded.cfg, key) == getattr(model.cfg, key), key
    assert [loaded.cfg.window_for(i) for i in range(2)] == \
        [model.cfg.window_for(i) for i in range(2)]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))  # past the windows
    np.testing.assert_allclose(np.asarray(loaded(ids)[0]), np.asarray(model(ids)[0]), atol=2e-5)
