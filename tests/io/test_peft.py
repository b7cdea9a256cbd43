"""PEFT export/import: exact round trip, PEFT key names / shapes / config fields, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from lowrank_jax.io.peft import export_peft, import_peft
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers

CFG = LlamaConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24)
TOKENS = (jnp.arange(12, dtype=jnp.int32).reshape(2, 6) * 5) % 64


def _adapted(ranks=None):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, [LoRARule(r"(q|v)_proj", rank=4, alpha=8.0), LoRARule("down_proj", rank=2)],
               rngs=nnx.Rngs(1), ranks=ranks)
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = jax.random.normal(jax.random.key(i), layer.lora_b[...].shape)
    return model


# Written from PEFT's documentation (developer_guides/checkpoint): for LlamaForCausalLM the keys
# are base_model.model.model.layers.{i}.<block>.<proj>.lora_{A,B}.weight, lora_A [r, in],
# lora_B [out, r]; the adapter name ".default" is stripped on save.
EXPECTED = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 16),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (16, 4),
    "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight": (4, 16),
    "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": (8, 4),
    "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": (2, 24),
    "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": (16, 2),
    "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": (4, 16),
    "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": (16, 4),
    "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight": (4, 16),
    "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight": (8, 4),
    "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight": (2, 24),
    "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight": (16, 2),
}


def test_export_keys_shapes_and_config(tmp_path):
    model = _adapted()
    export_peft(model, tmp_path, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert {k: v.shape for k, v in tensors.items()} == EXPECTED
    layer = model.layers[1].self_attn.v_proj
    np.testing.assert_array_equal(
        tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"],
        np.asarray(layer.lora_b[...]).T)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["use_rslora"] is False and config["use_dora"] is False
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert config["rank_pattern"] == {"model.layers.0.mlp.down_proj": 2,
                                      "model.layers.1.mlp.down_proj": 2}
    assert config["alpha_pattern"] == {"model.layers.0.mlp.down_proj": 2,
                                       "model.layers.1.mlp.down_proj": 2}
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_partial_targets_become_exact_regex(tmp_path):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, r"layers/1/self_attn/q_proj", rngs=nnx.Rngs(1))
    config = export_peft(model, tmp_path)
    assert config["target_modules"] == r"model\.layers\.1\.self_attn\.q_proj"


def test_export_import_round_trip_exact(tmp_path):
    model = _adapted(ranks={"layers/1/self_attn/q_proj": 3})
    out, _ = model(TOKENS)
    export_peft(model, tmp_path)
    fresh = Llama(CFG, rngs=nnx.Rngs(0))
    paths = import_peft(fresh, tmp_path)
    assert sorted(paths) == sorted(p for p, _ in lora_layers(model))
    for (p, a), (q, b) in zip(lora_layers(model), lora_layers(fresh)):
        assert p == q and a.rank == b.rank and a.scaling == b.scaling
        np.testing.assert_array_equal(a.lora_a[...], b.lora_a[...])
        np.testing.assert_array_equal(a.lora_b[...], b.lora_b[...])
    np.testing.assert_array_equal(fresh(TOKENS)[0], out)


def test_pissa_conversion_applies_to_original_base(tmp_path):
    original = Llama(CFG, rngs=nnx.Rngs(0))
    model = Llama(CFG, rngs=nnx.Rngs(0))
    apply_lora(model, LoRARule("up_proj", rank=2, init="pissa"), rngs=nnx.Rngs(1))
    initial = {p: (m.lora_a[...], m.lora_b[...]) for p, m in lora_layers(model)}
    for _, m in lora_layers(model):
        m.lora_b[...] = m.lora_b[...] * 1.5
    out, _ = model(TOKENS)
    config = export_peft(model, tmp_path, initial_adapters=initial)
    assert config["r"] == 4
    import_peft(original, tmp_path)
    np.testing.assert_allclose(original(TOKENS)[0], out, atol=2e-4)


def test_import_errors(tmp_path):
    model = _adapted()
    export_peft(model, tmp_path)
    wider = Llama(LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                              d_ff=24), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"down_proj has lora_A \(2, 24\) and lora_B \(16, 2\)"):
        import_peft(wider, tmp_path)
    shallow = Llama(LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                d_ff=24), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Available modules: .*layers/0/self_attn/q_proj"):
        import_peft(shallow, tmp_path)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        import_peft(shallow, tmp_path / "missing")
