"""hf tier: every checkpoint family against transformers itself (tiny random models, no download).

For each family transformers builds a tiny random model (``from_config``), every parameter is
perturbed (random init leaves biases at 0 and norms at 1/0, which hides bugs), it is saved with
``save_pretrained`` and loaded by the library: fp32 logits must agree to 1e-4. The library then
saves the model back and transformers must read the same logits, and (non-fused families) a
LoRA adapter exported by the library must load in PEFT with the library's logits.

Needs torch, transformers and peft (``pip install torch transformers peft``); run with
``python -m pytest -m hf tests/models/test_families_hf.py``. Measured diffs:
docs/results/real_checkpoints.md.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.hf

try:
    import torch
    import transformers
except ImportError as err:  # a clear failure, not a skip
    torch = transformers = None
    _IMPORT_ERROR = err
else:
    _IMPORT_ERROR = None

SEQ = 12  # longer than every sliding window below
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

FAMILIES = {
    "llama": dict(model_type="llama", head_dim=12, rope_theta=1e4, attention_bias=True),
    "llama3": dict(model_type="llama", head_dim=16, rope_theta=5e5, rope_scaling=LLAMA3,
                   tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", head_dim=12, sliding_window=5),
    "qwen2": dict(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=12, rope_theta=1e6),
    "gemma": dict(model_type="gemma", head_dim=12),
    "gemma2": dict(model_type="gemma2", head_dim=12, query_pre_attn_scalar=10,
                   sliding_window=5, attn_logit_softcapping=1.5, final_logit_softcapping=0.8,
                   tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", head_dim=12, num_hidden_layers=3,
                   query_pre_attn_scalar=10, sliding_window=5,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_theta=1e6, rope_local_base_freq=1e4,
                   rope_scaling={"rope_type": "linear", "factor": 8.0},
                   tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", pad_token_id=0, partial_rotary_factor=0.5, sliding_window=7,
                 max_position_embeddings=32, original_max_position_embeddings=8,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5],
                               "long_factor": [2.0, 3.0]}),
}


def _need_torch():
    if _IMPORT_ERROR is not None:
        pytest.fail(f"the hf tier needs torch, transformers and peft: pip install torch "
                    f"transformers peft ({_IMPORT_ERROR})")


def build_hf(name: str, folder, seed: int = 0):
    """A tiny random transformers model of family ``name``, perturbed, saved to ``folder``."""
    _need_torch()
    spec = {**COMMON, **FAMILIES[name]}
    model_type = spec.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **spec)
    config._attn_implementation = "eager"  # Gemma 2's soft-cap needs eager; same for all
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval().float()
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    return np.asarray(model(jnp.asarray(tokens))[0])


def tokens_for(seed=1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, COMMON["vocab_size"], (2, SEQ))


def as_transformers4(folder) -> None:
    """Rewrite a transformers-5 config.json in the transformers-4 format (rope_theta +
    rope_scaling, torch_dtype), as a folder saved by transformers 4 holds it."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_transformers_and_saves_back(name, tmp_path):
    from lowrank_jax.hub import load_model, save_model

    reference = build_hf(name, tmp_path / "hf")
    tokens = tokens_for()
    expected = hf_logits(reference, tokens)
    model, _ = load_model(tmp_path / "hf")
    got = our_logits(model, tokens)
    diff = float(np.abs(got - expected).max())
    print(f"\n{name}: max |logit diff| {diff:.2e} (logit std {expected.std():.3f})")
    assert diff < 1e-4, f"{name}: load parity {diff:.2e}"

    save_model(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager").float().eval()
    again = hf_logits(back, tokens)
    diff_back = float(np.abs(again - expected).max())
    print(f"{name}: saved back, transformers max |logit diff| {diff_back:.2e}")
    assert diff_back < 1e-5, f"{name}: save-back parity {diff_back:.2e}"


def test_llama3_scaling_reads_both_config_formats(tmp_path):
    """transformers 5 writes rope_parameters; transformers 4 wrote rope_theta + rope_scaling."""
    from lowrank_jax.hub import load_model

    reference = build_hf("llama3", tmp_path / "v5")
    written = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert written.get("rope_parameters", {}).get("rope_type") == "llama3", written
    tokens = tokens_for()
    expected = hf_logits(reference, tokens)
    reference.save_pretrained(tmp_path / "v4")
    as_transformers4(tmp_path / "v4")
    for fmt in ("v5", "v4"):
        model, _ = load_model(tmp_path / fmt)
        diff = float(np.abs(our_logits(model, tokens) - expected).max())
        print(f"\nllama3 ({fmt} config): max |logit diff| {diff:.2e}")
        assert diff < 1e-4, (fmt, diff)


def test_gemma3_multimodal_folder_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder: the text model under language_model."""
    from lowrank_jax.hub import load_model

    _need_torch()
    text = {**COMMON, **FAMILIES["gemma3"]}
    text.pop("model_type")
    config = transformers.Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    torch.manual_seed(0)
    full = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    full.save_pretrained(tmp_path / "mm")
    tokens = tokens_for()
    with torch.no_grad():
        expected = full(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    model, _ = load_model(tmp_path / "mm")
    diff = float(np.abs(our_logits(model, tokens) - expected).max())
    print(f"\ngemma3 multimodal (text): max |logit diff| {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_peft_adapter_exported_by_the_library_loads_in_peft(name, tmp_path):
    import jax
    from flax import nnx

    from lowrank_jax.hub import load_model
    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.nn import apply_lora

    try:
        import peft
    except ImportError as err:
        pytest.fail(f"needs peft: pip install peft ({err})")
    build_hf(name, tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    apply_lora(model, {r"self_attn/(q|v)_proj$": 4}, rngs=nnx.Rngs(0))
    # train-like adapters: B random (a fresh adapter has B = 0 and would prove nothing)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.value.shape))
    tokens = tokens_for()
    ours = our_logits(model, tokens)
    export_peft(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "hf"))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager").float().eval()
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    diff = float(np.abs(hf_logits(wrapped, tokens) - ours).max())
    print(f"\n{name}: PEFT adapter max |logit diff| {diff:.2e}")
    assert diff < 1e-4
