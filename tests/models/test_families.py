"""The checkpoint families as features of the one core, without torch (the hf tier,
test_families_hf.py, checks the same families against transformers itself).

Every family is built from a tiny HF-style ``config.json`` dictionary through
:func:`config_from_hf`, its parameters perturbed (random init leaves norms at 1 / 0 and biases
at 0, which hides bugs), and checked on invariants: save → load is exact, the scanned and
KV-cached runners equal the plain forward, a sliding window only sees its window, each RoPE
variant has the formula's frequencies, and every method family runs on every model family.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.hub import load_model, save_model
from lowrank_jax.models.families import config_from_hf
from lowrank_jax.models.generate import forward, prepare
from lowrank_jax.models.llama import KVCache, Llama
from lowrank_jax.models.tokenizer import ByteTokenizer
from pallas_kernels.rope import rope, rope_frequencies

# its module-scoped fixture is built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("models.test_families")

SEQ = 12  # longer than every sliding window below
BASE = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
HF_CONFIGS = {
    "llama": dict(model_type="llama", head_dim=12),
    "llama3": dict(model_type="llama", head_dim=16, tie_word_embeddings=True,
                   rope_parameters={"rope_theta": 5e5, **LLAMA3}),
    "mistral": dict(model_type="mistral", head_dim=12, sliding_window=5),
    "qwen2": dict(model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=12, rope_theta=1e6),
    "gemma": dict(model_type="gemma", head_dim=12),
    "gemma2": dict(model_type="gemma2", head_dim=12, query_pre_attn_scalar=10, sliding_window=5,
                   attn_logit_softcapping=1.5, final_logit_softcapping=0.8,
                   num_hidden_layers=2),
    "gemma3": dict(model_type="gemma3_text", head_dim=12, num_hidden_layers=2,
                   query_pre_attn_scalar=10, sliding_window=5,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                          "rope_theta": 1e6}}),
    "phi3": dict(model_type="phi3", sliding_window=7, max_position_embeddings=32,
                 original_max_position_embeddings=8,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5],
                                  "long_factor": [2.0, 3.0]}),
}
FAMILIES = sorted(HF_CONFIGS)
# the default suite runs each method on the families that between them turn on every feature
# (llama3 scaling, q/k/v biases, Gemma 3's norms / per-layer RoPE / windows, Phi-3's fused and
# longrope weights); the others run in the slow tier (`pytest -m slow`). Loading, saving back
# and `finetune --model` run on every family in the default suite.
CORE_FAMILIES = ("gemma3", "llama3", "phi3", "qwen2")
METHOD_FAMILIES = [name if name in CORE_FAMILIES else pytest.param(name, marks=pytest.mark.slow)
                   for name in FAMILIES]


def family_model(name: str, seed: int = 0) -> Llama:
    """A tiny random model of family ``name`` with every parameter perturbed."""
    cfg = config_from_hf({**BASE, **HF_CONFIGS[name]}, source=name)
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1)
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        value = var[...]
        noise = jax.random.normal(jax.random.fold_in(key, i), value.shape, value.dtype)
        var.set_value(value + 0.1 * noise)
    return model


def tokens(batch=2, length=SEQ, seed=3):
    return jnp.asarray(np.random.default_rng(seed).integers(1, 256, (batch, length)))


def logits(model, ids):
    return np.asarray(_forward(model, ids))


_forward = nnx.jit(lambda model, ids: model(ids)[0])  # one compiled program, not op by op


@pytest.fixture(scope="module")
def models():
    return {name: family_model(name) for name in FAMILIES}


# ----------------------------------------------------------------------- config translation


def test_each_family_turns_on_its_features(models):
    cfg = {name: m.cfg for name, m in models.items()}
    assert cfg["llama"].family == "llama" and not cfg["llama"].qkv_bias
    assert cfg["llama3"].rope_scaling["rope_type"] == "llama3" and cfg["llama3"].rope_theta == 5e5
    assert cfg["mistral"].window_for(0) == 5
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias and cfg["qwen2"].tie_embeddings
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim == 12 != 32 // 4
    g2, g3 = cfg["gemma2"], cfg["gemma3"]
    assert (g2.norm_offset, g2.embed_scale, g2.hidden_act, g2.sandwich_norms) == \
        (1.0, True, "gelu_pytorch_tanh", True)
    assert [g2.window_for(i) for i in range(2)] == [5, None]  # layer 0 slides
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_pre_attn_scalar) == \
        (1.5, 0.8, 10.0)
    assert g3.qk_norm and g3.rope_local_theta == 1e4 and g3.rope_theta == 1e6
    assert g3.rope_for(0).inv_freq[1] * 8 != pytest.approx(g3.rope_for(1).inv_freq[1] * 8)
    assert cfg["phi3"].partial_rotary_factor == 0.5 and cfg["phi3"].original_max_seq_len == 8
    assert not g2.uniform_layers and cfg["qwen3"].uniform_layers


def test_transformers4_and_5_configs_read_the_same():
    v5 = {**BASE, "model_type": "llama", "rope_theta": None, "rope_scaling": None,
          "dtype": "float32", "rope_parameters": {"rope_theta": 5e5, **LLAMA3}}
    v4 = {**BASE, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": LLAMA3,
          "torch_dtype": "float32"}
    assert config_from_hf(v5) == config_from_hf(v4)
    assert config_from_hf(v5).rope_theta == 5e5  # not the 1e4 default (issue 50)
    g3_v4 = {**BASE, **HF_CONFIGS["gemma3"]}
    g3_v4.pop("rope_parameters")
    g3_v4.update(rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    g3_v5 = {**BASE, **HF_CONFIGS["gemma3"]}
    assert config_from_hf(g3_v4) == config_from_hf(g3_v5)


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act='gelu' is not implemented"),
    ("mlp_bias", True, "mlp_bias"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
    ("some_new_switch", 1, "field 'some_new_switch'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_unimplemented_config_fields_are_refused_by_name(field, value, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**BASE, "model_type": "llama", field: value})


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, models):
    from safetensors.numpy import load_file, save_file

    folder = save_model(models["qwen2"], tmp_path / "m")
    tensors = load_file(f"{folder}/model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.bias"][3] = np.nan
    save_file(tensors, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*non-finite"):
        load_model(folder)


# ----------------------------------------------------------------------- RoPE variants


def test_llama3_frequencies_match_the_formula_written_out():
    """The spec's formula, one frequency at a time (head_dim 16 reaches all three bands)."""
    dim, theta, factor, low, high, old = 16, 5e5, 8.0, 1.0, 4.0, 8192
    got = rope_frequencies(dim, theta, LLAMA3).inv_freq
    bands = set()
    for i in range(dim // 2):
        inv = 1.0 / theta ** (2 * i / dim)
        wavelength = 2 * math.pi / inv
        if wavelength < old / high:
            want, band = inv, "high"
        elif wavelength > old / low:
            want, band = inv / factor, "low"
        else:
            s = (old / wavelength - low) / (high - low)
            want, band = (1 - s) * inv / factor + s * inv, "medium"
        bands.add(band)
        assert got[i] == pytest.approx(want, rel=1e-5), (i, band)
    assert bands == {"high", "medium", "low"}


def test_longrope_switches_to_long_factors_past_the_original_context():
    f = rope_frequencies(8, 1e4, {"rope_type": "longrope", "short_factor": [1.0, 1.5],
                                  "long_factor": [2.0, 3.0]}, partial_rotary_factor=0.5,
                         max_position_embeddings=32, original_max_position_embeddings=8)
    base = 1.0 / 1e4 ** (np.arange(0, 4, 2) / 4)
    np.testing.assert_allclose(f.inv_freq, base / [1.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose(f.long_inv_freq, base / [2.0, 3.0], rtol=1e-6)
    assert f.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(8)))
    from lowrank_jax.models.llama import apply_rope

    x = jax.random.normal(jax.random.key(0), (1, 9, 1, 8))
    short = apply_rope(x[:, :8], jnp.arange(8)[None], f)  # positions < 8: short factors
    np.testing.assert_allclose(
        short, rope(x[:, :8], jnp.arange(8), inv_freq=f.inv_freq,
                    attention_scaling=f.attention_scaling), atol=1e-6)
    long = apply_rope(x, jnp.arange(9)[None], f)  # position 8 reached: long factors
    np.testing.assert_allclose(
        long, rope(x, jnp.arange(9), inv_freq=f.long_inv_freq,
                   attention_scaling=f.attention_scaling), atol=1e-6)


def test_partial_rotary_leaves_the_other_dimensions_alone():
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 8))
    inv = rope_frequencies(8, 1e4, partial_rotary_factor=0.5).inv_freq
    out = rope(x, jnp.arange(5), inv_freq=inv)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    np.testing.assert_allclose(out[..., :4], rope(x[..., :4], jnp.arange(5), 1e4), atol=1e-6)


def test_sliding_window_sees_only_its_window(models):
    """Scores depend on relative positions only, so the logits at position p of a window-W
    model equal the last logits of the W tokens ending at p, run on their own."""
    model, ids = models["mistral"], tokens(1)  # one layer: the receptive field is the window
    full = logits(model, ids)
    for p in (4, 8, 11):
        alone = logits(model, ids[:, p - 4:p + 1])[:, -1]
        np.testing.assert_allclose(full[:, p], alone, atol=2e-5)
    unwindowed = Llama(dataclasses.replace(model.cfg, sliding_window=None), rngs=nnx.Rngs(0))
    nnx.update(unwindowed, nnx.state(model))
    other = logits(unwindowed, ids)
    np.testing.assert_allclose(other[:, :5], full[:, :5], atol=2e-5)  # inside the window
    assert np.abs(other[:, 11] - full[:, 11]).max() > 1e-3  # the check has teeth


# ----------------------------------------------------------------------- runners


@pytest.mark.parametrize("name", METHOD_FAMILIES)
def test_scanned_and_cached_runners_equal_the_forward(name, models):
    # Phi-3 past its original context rotates with the long factors, and like transformers the
    # cache keeps the keys it rotated before: compare within the original context there
    length = 8 if name == "phi3" else SEQ
    model, ids = models[name], tokens(2, length)
    want = logits(model, ids)
    static, state = prepare(model)
    assert static.mode == ("scan" if model.cfg.uniform_layers else "full")
    run = jax.jit(forward, static_argnums=0)
    got, _ = run(static, state, ids)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    # prefill 5 tokens, then decode one at a time past the sliding window
    cache = KVCache.empty(model.cfg, 2, length)
    first, cache = run(static, state, ids[:, :5], cache)
    steps = [first]
    for t in range(5, length):
        out, cache = run(static, state, ids[:, t:t + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(np.concatenate([np.asarray(s) for s in steps], 1), want,
                               atol=2e-5)


# ----------------------------------------------------------------------- save / load / CLI


@pytest.mark.parametrize("name", FAMILIES)
def test_save_model_round_trips_and_finetune_runs(name, models, tmp_path):
    from safetensors import safe_open

    from lowrank_jax.cli import main
    from lowrank_jax.models.families import ARCHITECTURES

    model = models[name]
    folder = save_model(model, tmp_path / "model", tokenizer=ByteTokenizer())
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == model.cfg.family
    assert config["architectures"] == [ARCHITECTURES[model.cfg.family]]
    with safe_open(f"{folder}/model.safetensors", "numpy") as f:
        keys = set(f.keys())
    fused = "model.layers.0.self_attn.qkv_proj.weight" in keys
    assert fused == (name == "phi3") and ("lm_head.weight" in keys) != model.cfg.tie_embeddings
    loaded, tokenizer = load_model(folder)
    assert loaded.cfg == model.cfg and isinstance(tokenizer, ByteTokenizer)
    np.testing.assert_array_equal(logits(loaded, tokens()), logits(model, tokens()))
    out = tmp_path / "run"
    assert main(["finetune", "--model", folder, "--steps", "2", "--batch-size", "2",
                 "--seq-len", "16", "--rank", "2", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert np.isfinite(summary["final_loss"]) and (out / "adapter" / "adapter_config.json").exists()


# ----------------------------------------------------------------------- method families


@pytest.mark.parametrize("name", METHOD_FAMILIES)
def test_lora_and_qlora_on_every_family(name, models):
    from lowrank_jax.nn import apply_lora
    from lowrank_jax.quant import quantize_projections

    model, ids = nnx.clone(models[name]), tokens()
    want = logits(model, ids)
    apply_lora(model, {r"self_attn/(q|v)_proj$|mlp/down_proj$": 2}, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(logits(model, ids), want, atol=1e-6)  # B = 0 at init
    graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora):
        m = nnx.merge(graph, lora, rest)
        return jnp.mean(m(ids)[0] ** 2)

    grads = jax.tree.leaves(jax.jit(jax.grad(loss))(lora))
    assert grads and all(np.isfinite(g).all() for g in grads)
    assert any(float(jnp.abs(g).max()) > 0 for g in grads)
    qmodel = nnx.clone(models[name])
    errors = quantize_projections(qmodel, r"(self_attn|mlp)/\w+_proj$", "nf4", group_size=16)
    assert len(errors) == 7 * qmodel.cfg.n_layers and 0 < max(errors.values()) < 0.2
    quantized = logits(qmodel, ids)
    apply_lora(qmodel, {r"self_attn/(q|v)_proj$": 2}, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(logits(qmodel, ids), quantized, atol=1e-6)  # QLoRA, B = 0


@pytest.mark.parametrize("name", METHOD_FAMILIES)
def test_factorize_and_capture_on_every_family(name, models):
    from lowrank_jax.curvature import kfac
    from lowrank_jax.hub import factorize_projections
    from lowrank_jax.nn.capture import capture

    model, ids = models[name], tokens()
    want = logits(model, ids)
    full_rank = factorize_projections(nnx.clone(model), 1.0)
    np.testing.assert_allclose(logits(full_rank, ids), want, atol=1e-4)
    # capture (CrispEdit's K-FAC, calibration): layer 0's q_proj sees input_layernorm(embed)
    with capture(model, ["layers/0/self_attn/q_proj"]) as recorder:
        model(ids)
    x = model.embed_tokens(ids)
    if model.cfg.embed_scale:
        x = x * model.cfg.d_model ** 0.5
    np.testing.assert_allclose(recorder.inputs["layers/0/self_attn/q_proj"][0],
                               model.layers[0].input_layernorm(x), atol=1e-5)
    factors = kfac.estimate_kfac_factors(model, [kfac.lm_batch(ids)],
                                         targets=["layers/0/self_attn/q_proj"])
    a = np.asarray(factors["layers/0/self_attn/q_proj"].A)
    inputs = np.asarray(model.layers[0].input_layernorm(x))[:, :-1].reshape(-1, 32)
    np.testing.assert_allclose(a, inputs.T @ inputs / len(inputs), atol=1e-5)


@pytest.mark.parametrize("name", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow),
                                  pytest.param("llama3", marks=pytest.mark.slow),
                                  pytest.param("phi3", marks=pytest.mark.slow)])
def test_unisvq_calibration_follows_each_layers_inputs(name, models):
    """UniSVQ's layer-by-layer calibration sees the inputs the full forward gives each layer
    (Gemma's embedding scale, each layer's window and RoPE base): the last layer's calibration
    Hessian equals the one captured in a plain forward."""
    from lowrank_jax.quantize.pipeline import calibration_hessians, quantize_model
    from lowrank_jax.quant.unisvq import UniSVQConfig

    model, ids = nnx.clone(models[name]), tokens(4, 8)
    want = logits(model, ids)
    paths = [f"layers/{model.cfg.n_layers - 1}/mlp/down_proj"]
    reference = calibration_hessians(model, ids, paths)[paths[0]]
    seen = {}
    import lowrank_jax.quantize.pipeline as pipeline

    original = pipeline._capture_hessians

    def spy(layer, x, chunk, layer_idx=0):
        y, h = original(layer, x, chunk, layer_idx)
        seen[layer_idx if not model.cfg.uniform_layers else len(seen)] = h
        return y, h

    pipeline._capture_hessians = spy
    try:
        quantize_model(model, ids, method="unisvq", bits=4, progress=False,
                       layers=[model.cfg.n_layers - 1], cfg=UniSVQConfig(finetune_steps=0))
    finally:
        pipeline._capture_hessians = original
    last = seen[model.cfg.n_layers - 1]["down_proj"]
    damp = 1e-2 * jnp.mean(jnp.diag(last))
    np.testing.assert_allclose(last + damp * jnp.eye(last.shape[0]), reference, rtol=1e-3,
                               atol=1e-4)
    assert np.isfinite(logits(model, ids)).all() and logits(model, ids).shape == want.shape


@pytest.mark.parametrize("name", METHOD_FAMILIES)
def test_kv_compression_is_exact_at_full_rank_or_names_what_it_lacks(name, models):
    """xKV on a plain-RoPE family at full rank decodes the exact logits; on a family whose
    RoPE / windows / soft-cap the compressed caches do not implement it refuses by name."""
    from lowrank_jax.kv import xkv_decode_step, xkv_prefill

    model, ids = models[name], tokens(1, 9)
    blockers = model.cfg.kv_compression_blockers()
    assert bool(blockers) == (name in ("llama3", "mistral", "gemma2", "gemma3", "phi3"))
    if blockers:
        with pytest.raises(ValueError, match=f"not implemented for a .*{blockers[0][:12]}"):
            xkv_prefill(model, ids[:, :8], rank=8, group_size=1)
        return
    cache = xkv_prefill(model, ids[:, :8], rank=8, group_size=1, sink_tokens=0)
    got, _ = xkv_decode_step(model, cache, ids[:, 8])
    np.testing.assert_allclose(np.asarray(got), logits(model, ids)[:, 8], atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_quantized_folder_keeps_the_family_norms(name, models, tmp_path):
    """A quantized model of a family with q/k and sandwich norms saves and loads exactly."""
    from lowrank_jax.quantize.pipeline import quantize_model

    model, ids = nnx.clone(models[name]), tokens()
    quantize_model(model, None, method="rtn", bits=8, group_size=16, progress=False)
    folder = save_model(model, tmp_path / "q")
    loaded, _ = load_model(folder)
    np.testing.assert_array_equal(logits(loaded, ids), logits(model, ids))


def test_quantizing_away_projection_biases_is_refused(models):
    from lowrank_jax.quantize.pipeline import quantize_model

    with pytest.raises(ValueError, match="layers/0/q_proj.*has a bias"):
        quantize_model(nnx.clone(models["qwen2"]), None, method="rtn", bits=8, group_size=16,
                       progress=False)
