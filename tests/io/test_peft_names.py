"""PEFT names through name maps: HF names everywhere in the file, fused kernels split / stacked /
refused in both directions, Phi-3's fused modules from our Llama.

``GemmaLM`` is laid out as gemma / tunix write Gemma: ``q_einsum`` ``'BTD,NDH->BTNH'``, the
fused ``kv_einsum`` ``'BSD,CKDH->CBSKH'`` (or ``qkv_einsum`` ``'BTD,SNDH->SBTNH'`` when every
head has its own k/v), ``attn_vec_einsum`` ``'BTNH,NHD->BTD'``, the fused MLP
``gating_einsum`` ``'BTD,CDF->CBTF'`` and ``linear``.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from lowrank_jax.io import Fused, export_peft, import_peft, name_mapper
from lowrank_jax.io.peft_names import HF_DECODER_MAP, targets
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers

D, N, H, F, V = 16, 2, 4, 24, 32
P = "base_model.model.model.layers."


class Einsum(nnx.Module):
    """tunix's einsum layer (``einsum_str`` + kernel ``w``)."""

    def __init__(self, einsum_str, shape, rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(jax.random.normal(rngs.params(), shape) / np.sqrt(shape[-2]))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])


class Attention(nnx.Module):
    def __init__(self, kv_heads, rngs):
        self.kv_heads = kv_heads
        if kv_heads == N:
            self.qkv_einsum = Einsum("BTD,SNDH->SBTNH", (3, N, D, H), rngs)
        else:
            self.q_einsum = Einsum("BTD,NDH->BTNH", (N, D, H), rngs)
            self.kv_einsum = Einsum("BSD,CKDH->CBSKH", (2, kv_heads, D, H), rngs)
        self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (N, H, D), rngs)

    def __call__(self, x):
        if self.kv_heads == N:
            q, k, v = self.qkv_einsum(x)
        else:
            q = self.q_einsum(x)
            k, v = self.kv_einsum(x)
            k, v = (jnp.repeat(t, N // self.kv_heads, axis=2) for t in (k, v))
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(H)
        t = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        return self.attn_vec_einsum(jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(scores), v))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.gating_einsum = Einsum("BTD,CDF->CBTF", (2, D, F), rngs)
        self.linear = Einsum("BTF,FD->BTD", (F, D), rngs)

    def __call__(self, x):
        gate, up = self.gating_einsum(x)
        return self.linear(jax.nn.gelu(gate) * up)


class Block(nnx.Module):
    def __init__(self, kv_heads, rngs):
        self.attn, self.mlp = Attention(kv_heads, rngs), MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class GemmaLM(nnx.Module):
    def __init__(self, kv_heads=1, seed=0):
        rngs = nnx.Rngs(seed)
        self.embedder = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([Block(kv_heads, rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embedder.attend(x)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 7)), jnp.int32)


def _randomize(model, seed=1):
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = jax.random.normal(jax.random.key(seed + i), layer.lora_b[...].shape)


def _adapted_gemma(kv_heads=1):
    model = GemmaLM(kv_heads)
    apply_lora(model, [LoRARule("einsum", rank=3, alpha=6.0), LoRARule("linear", rank=2)],
               rngs=nnx.Rngs(2))
    _randomize(model)
    return model


def test_builtin_maps_know_the_ecosystem_spellings():
    gemma = name_mapper("gemma")
    assert gemma("layers/3/attn/q_einsum") == "model.layers.3.self_attn.q_proj"
    assert gemma("layers/3/attn/attn_vec_einsum") == "model.layers.3.self_attn.o_proj"
    assert gemma("layers/3/attn/kv_einsum") == ("model.layers.3.self_attn.k_proj",
                                                "model.layers.3.self_attn.v_proj")
    assert len(gemma("layers/0/attn/qkv_einsum")) == 3
    assert gemma("layers/0/mlp/gating_einsum") == ("model.layers.0.mlp.gate_proj",
                                                   "model.layers.0.mlp.up_proj")
    assert gemma("layers/0/mlp/linear") == "model.layers.0.mlp.down_proj"
    maxtext = name_mapper("llama")
    assert [maxtext(f"decoder/layers/1/self_attention/{n}").rsplit(".", 1)[1]
            for n in ("query", "key", "value", "out")] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert [maxtext(f"layers/1/mlp/{n}").rsplit(".", 1)[1] for n in ("wi_0", "wi_1", "wo")] == [
        "gate_proj", "up_proj", "down_proj"]
    assert name_mapper("hf")("model/layers/2/self_attn/q_proj") == "model.layers.2.self_attn.q_proj"
    phi3 = [targets(f"layers/0/self_attn/{n}_proj", "phi3")[0] for n in "qkv"]
    assert {t.name for t in phi3} == {"model.layers.0.self_attn.qkv_proj"}
    assert [t.part for t in phi3] == [0, 1, 2]
    whole = targets("layers/0/attn/qkv_einsum", "phi3")
    assert len(whole) == 1 and whole[0].part is None and whole[0].parts == ("q", "k", "v")
    with pytest.raises(ValueError, match="no entry maps the module path 'layers/0/attn/rotary'"):
        gemma("layers/0/attn/rotary")


def test_gemma_export_uses_hf_names_everywhere_and_splits_fused_kernels(tmp_path):
    model = _adapted_gemma(kv_heads=1)
    config = export_peft(model, tmp_path, name_map="gemma")
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                        "up_proj", "v_proj"]
    assert config["r"] == 3 and config["lora_alpha"] == 6
    assert config["rank_pattern"] == {f"model.layers.{i}.mlp.down_proj": 2 for i in range(2)}
    assert config["alpha_pattern"] == {f"model.layers.{i}.mlp.down_proj": 2 for i in range(2)}
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    shapes = {k[len(P) + 2:]: v.shape for k, v in tensors.items() if k.startswith(P + "0.")}
    assert shapes == {  # HF widths: q N*H, k/v one head (K*H), gate/up F
        "self_attn.q_proj.lora_A.weight": (3, D), "self_attn.q_proj.lora_B.weight": (N * H, 3),
        "self_attn.k_proj.lora_A.weight": (3, D), "self_attn.k_proj.lora_B.weight": (H, 3),
        "self_attn.v_proj.lora_A.weight": (3, D), "self_attn.v_proj.lora_B.weight": (H, 3),
        "self_attn.o_proj.lora_A.weight": (3, N * H), "self_attn.o_proj.lora_B.weight": (D, 3),
        "mlp.gate_proj.lora_A.weight": (3, D), "mlp.gate_proj.lora_B.weight": (F, 3),
        "mlp.up_proj.lora_A.weight": (3, D), "mlp.up_proj.lora_B.weight": (F, 3),
        "mlp.down_proj.lora_A.weight": (2, F), "mlp.down_proj.lora_B.weight": (D, 2)}
    # each slice is the kernel's own delta: kv_einsum's k rows are HF k_proj's rows
    kv = model.layers[0].attn.kv_einsum
    delta = np.asarray(kv.delta()).T  # [out = (C, K, H), in]
    k_delta = kv.scaling * tensors[P + "0.self_attn.k_proj.lora_B.weight"] @ tensors[
        P + "0.self_attn.k_proj.lora_A.weight"]
    np.testing.assert_allclose(k_delta, delta[:H], atol=1e-6)


@pytest.mark.parametrize("kv_heads", [1, N])
def test_fused_kernels_round_trip_as_one_adapter(tmp_path, kv_heads):
    model = _adapted_gemma(kv_heads)
    expected = model(TOKENS)
    export_peft(model, tmp_path, name_map="gemma")
    fresh = GemmaLM(kv_heads)
    paths = import_peft(fresh, tmp_path, name_map="gemma")
    assert sorted(paths) == sorted(p for p, _ in lora_layers(model))
    for (path, src), (_, dst) in zip(lora_layers(model), lora_layers(fresh)):
        assert dst.rank == src.rank and dst.scaling == pytest.approx(src.scaling), path
        np.testing.assert_allclose(dst.lora_a[...], src.lora_a[...], atol=1e-6)
        np.testing.assert_allclose(dst.lora_b[...], src.lora_b[...], atol=1e-6)
    np.testing.assert_allclose(fresh(TOKENS), expected, atol=1e-5)


def test_fused_kernel_to_one_plain_hf_name_is_refused(tmp_path):
    model = _adapted_gemma(kv_heads=1)
    wrong = {r"layers/(\d+)/attn/kv_einsum": r"model.layers.\1.self_attn.k_proj",
             **dict(HF_DECODER_MAP)}
    with pytest.raises(ValueError, match=r"'layers/0/attn/kv_einsum' is a fused kernel .* "
                                         r"lora_B 2x too wide"):
        export_peft(model, tmp_path, name_map=wrong)
    with pytest.raises(ValueError, match="maps to 3 HF modules"):
        export_peft(model, tmp_path, name_map={
            r"layers/(\d+)/attn/kv_einsum": ("a", "b", "c"),
            **dict(HF_DECODER_MAP)})
    assert not (tmp_path / "adapter_config.json").exists()



def test_an_hf_q_v_adapter_fills_the_v_slice_of_kv_einsum(tmp_path):
    """PEFT's default targets (q_proj, v_proj) on HF Gemma, imported into gemma's layout: the
    kv_einsum adapter gets v's rows of B, and zeros for k."""
    from safetensors.numpy import save_file

    model = _adapted_gemma(kv_heads=1)
    export_peft(model, tmp_path, name_map="gemma")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    kept = {k: v for k, v in tensors.items() if "k_proj" not in k and ".mlp." not in k
            and "o_proj" not in k}
    save_file(kept, str(tmp_path / "adapter_model.safetensors"), metadata={"format": "pt"})
    fresh = GemmaLM(kv_heads=1)
    assert import_peft(fresh, tmp_path, name_map="gemma") == [
        f"layers/{i}/attn/{n}" for i in range(2) for n in ("kv_einsum", "q_einsum")]
    for i in range(2):
        src, dst = model.layers[i].attn.kv_einsum, fresh.layers[i].attn.kv_einsum
        assert dst.rank == src.rank
        delta, expected = np.asarray(dst.delta()), np.asarray(src.delta())
        assert not delta[:, :H].any()  # k: not in the adapter
        np.testing.assert_allclose(delta[:, H:], expected[:, H:], atol=1e-6)


def _llama(seed=0):
    return Llama(LlamaConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2,
                             d_ff=F), rngs=nnx.Rngs(seed))


def test_our_llama_exports_q_k_v_and_gate_up_onto_phi3_fused_modules(tmp_path):
    model = _llama()
    apply_lora(model, [LoRARule(r"(q|k|v)_proj", rank=2, alpha=4.0),
                       LoRARule(r"(gate|up)_proj", rank=3, alpha=3.0)], rngs=nnx.Rngs(1))
    _randomize(model)
    expected, _ = model(TOKENS)
    config = export_peft(model, tmp_path, name_map="phi3")
    assert config["target_modules"] == ["gate_up_proj", "qkv_proj"]
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    hd = D // 4
    a = tensors[P + "0.self_attn.qkv_proj.lora_A.weight"]
    b = tensors[P + "0.self_attn.qkv_proj.lora_B.weight"]
    assert a.shape == (6, D) and b.shape == ((4 + 2 + 2) * hd, 6)  # rank 3r, rows q|k|v
    assert tensors[P + "0.mlp.gate_up_proj.lora_B.weight"].shape == (2 * F, 6)
    # rank 3r, alpha 3α through the patterns (or r / lora_alpha): the scale is unchanged
    ranks = {**{k: config["r"] for k in ("qkv", "gate_up")},
             **{k.split(".")[-1][:-5]: v for k, v in config["rank_pattern"].items()}}
    alphas = {**{k: config["lora_alpha"] for k in ("qkv", "gate_up")},
              **{k.split(".")[-1][:-5]: v for k, v in config["alpha_pattern"].items()}}
    assert (ranks["qkv"], alphas["qkv"]) == (6, 12) and (ranks["gate_up"], alphas["gate_up"]) == (
        6, 6)
    attn = model.layers[0].self_attn
    stacked = np.concatenate([np.asarray(getattr(attn, f"{n}_proj").delta()).T for n in "qkv"])
    np.testing.assert_allclose(alphas["qkv"] / ranks["qkv"] * b @ a, stacked, atol=1e-6)
    assert not b[:4 * hd, 2:].any() and not b[4 * hd:6 * hd, :2].any()  # block diagonal
    fresh = _llama()
    assert sorted(import_peft(fresh, tmp_path, name_map="phi3")) == sorted(
        p for p, _ in lora_layers(model))
    assert {m.rank for _, m in lora_layers(fresh) if "attn" in _} == {2}
    np.testing.assert_allclose(fresh(TOKENS)[0], expected, atol=1e-5)


def test_phi3_parts_no_adapter_covers_are_zero_and_stay_unadapted(tmp_path):
    model = _llama()
    apply_lora(model, {r"(q|v)_proj": 2}, rngs=nnx.Rngs(1))
    _randomize(model)
    expected, _ = model(TOKENS)
    export_peft(model, tmp_path, name_map="phi3")
    b = load_file(tmp_path / "adapter_model.safetensors")[P + "1.self_attn.qkv_proj.lora_B.weight"]
    hd = D // 4
    assert b.shape == (8 * hd, 4) and not b[4 * hd:6 * hd].any()  # the k rows
    fresh = _llama()
    assert sorted(import_peft(fresh, tmp_path, name_map="phi3")) == sorted(
        p for p, _ in lora_layers(model))
    np.testing.assert_allclose(fresh(TOKENS)[0], expected, atol=1e-5)
    at_init = _llama()  # B = 0 everywhere: which blocks were adapted is unknown, all are
    apply_lora(at_init, {r"(q|v)_proj": 2}, rngs=nnx.Rngs(1))
    export_peft(at_init, tmp_path / "init", name_map="phi3")
    assert len(import_peft(_llama(), tmp_path / "init", name_map="phi3")) == 6


def test_gemma_qkv_einsum_exports_whole_onto_phi3_qkv_proj(tmp_path):
    model = _adapted_gemma(kv_heads=N)
    expected = model(TOKENS)
    config = export_peft(model, tmp_path, name_map="phi3")
    assert config["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert tensors[P + "0.self_attn.qkv_proj.lora_B.weight"].shape == (3 * N * H, 3)
    assert tensors[P + "0.mlp.gate_up_proj.lora_B.weight"].shape == (2 * F, 3)
    fresh = GemmaLM(N)
    import_peft(fresh, tmp_path, name_map="phi3")
    np.testing.assert_allclose(fresh(TOKENS), expected, atol=1e-5)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["rank_pattern"] == {f"model.layers.{i}.mlp.down_proj": 2 for i in range(2)}


def test_a_user_map_with_fused_parts(tmp_path):
    """A user's own map: q/k/v einsums as the row blocks of one fused module of their HF
    model (``attn.c_attn`` in GPT-2 naming)."""
    model = _llama()
    apply_lora(model, {r"(q|k|v)_proj": 2}, rngs=nnx.Rngs(1))
    _randomize(model)
    user_map = {r"layers/(\d+)/self_attn/(q|k|v)_proj": Fused(r"h.\1.attn.c_attn", r"\2",
                                                              ("q", "k", "v")),
                r"layers/(\d+)/self_attn/o_proj": r"h.\1.attn.c_proj",
                r"layers/(\d+)/mlp/(\w+)": r"h.\1.mlp.\2", "lm_head": "lm_head"}
    config = export_peft(model, tmp_path, name_map=user_map)
    assert config["target_modules"] == ["c_attn"] and config["r"] == 6
    expected, _ = model(TOKENS)
    fresh = _llama()
    import_peft(fresh, tmp_path, name_map=user_map)
    np.testing.assert_allclose(fresh(TOKENS)[0], expected, atol=1e-5)


# ------------------------------------------------------------------ hf tier: logits in real PEFT
HF_INSTALL = "pip install torch transformers peft (CPU wheels are enough)"


def _hf_llama_and_phi3(base, folder):
    """HF Llama from our base (``save_model``) and the Phi-3 model holding the same weights
    fused (``qkv_proj`` = q; k; v rows, ``gate_up_proj`` = gate; up rows)."""
    try:
        import torch
        import transformers
    except ImportError as err:
        raise AssertionError(f"the hf tier needs torch, transformers and peft: {HF_INSTALL}") \
            from err
    from lowrank_jax.hub import save_model

    save_model(base, folder)
    llama = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                               torch_dtype=torch.float32)
    c = llama.config
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, pad_token_id=0,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}))
    state = dict(llama.state_dict())
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        state[pre + "self_attn.qkv_proj.weight"] = torch.cat(
            [state.pop(pre + f"self_attn.{n}_proj.weight") for n in "qkv"])
        state[pre + "mlp.gate_up_proj.weight"] = torch.cat(
            [state.pop(pre + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    missing, unexpected = phi3.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k or "lm_head" in k for k in missing), (
        missing, unexpected)
    if c.tie_word_embeddings:
        phi3.tie_weights()
    return llama.eval(), phi3.eval()


@pytest.mark.hf
@pytest.mark.parametrize("name_map", [None, "phi3"])
def test_our_llama_adapter_gives_our_logits_in_hf_peft(tmp_path, name_map):
    """Our Llama ↔ HF Llama: the base weights map, so PEFT's logits are ours; with
    ``name_map="phi3"`` the q/k/v and gate/up adapters go onto a Phi-3 model's fused modules."""
    import torch
    from peft import PeftModel

    model = _llama()
    apply_lora(model, [LoRARule(r"(q|k|v|o)_proj", rank=2, alpha=4.0),
                       LoRARule(r"(gate|up|down)_proj", rank=3)], rngs=nnx.Rngs(1))
    _randomize(model)
    ours = np.asarray(model(TOKENS)[0])
    export_peft(model, tmp_path / "adapter", name_map=name_map)
    llama, phi3 = _hf_llama_and_phi3(_llama(), tmp_path / "base")
    target = phi3 if name_map == "phi3" else llama
    peft_model = PeftModel.from_pretrained(target, str(tmp_path / "adapter")).eval()
    result = peft_model.load_adapter(str(tmp_path / "adapter"), adapter_name="again")
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k and ".again." in k]
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(TOKENS), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


def test_our_llama_of_the_phi3_family_fuses_by_default(tmp_path):
    """``cfg.family == "phi3"`` (the HF ``model_type`` our Llama was built for) picks Phi-3's
    fused names without a ``name_map``."""

    class Phi3Config:  # our config, as the loader builds it for a phi3 checkpoint
        def __init__(self, cfg):
            self.cfg, self.family = cfg, "phi3"

        def __getattr__(self, name):
            return getattr(self.cfg, name)

    model = _llama()
    apply_lora(model, {r"(q|k|v)_proj": 2}, rngs=nnx.Rngs(1))
    _randomize(model)
    expected, _ = model(TOKENS)
    model.cfg = Phi3Config(model.cfg)
    assert export_peft(model, tmp_path)["target_modules"] == ["qkv_proj"]
    fresh = _llama()
    fresh.cfg = Phi3Config(fresh.cfg)
    assert len(import_peft(fresh, tmp_path)) == 6
    np.testing.assert_allclose(fresh(TOKENS)[0], expected, atol=1e-5)
