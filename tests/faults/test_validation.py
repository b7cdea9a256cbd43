"""Build 4: every config field and CLI number is validated when parsed (sizes, divisibility,
ranges, signs), and loaded adapters are checked (finite weights, readable config)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lowrank_jax.train import load_config


@pytest.mark.parametrize("override, message", [
    ("model.n_kv_heads=0", "model.n_kv_heads=0 must be a positive integer"),
    ("model.n_heads=0", "model.n_heads=0 must be a positive integer"),
    ("model.d_model=-8", "model.d_model=-8 must be a positive integer"),
    ("model.n_layers=0", "model.n_layers=0 must be a positive integer"),
    ("model.d_model=15", "model.d_model=15 is not divisible by n_heads=2"),
    ("model.n_kv_heads=3", "model.n_heads=2 must be a multiple of n_kv_heads=3"),
    ("model.vocab_size=10", "model.vocab_size=10 is too small for the byte-level corpus"),
    ("run_dir=", "run_dir is empty"),
    ("train.seed=-1", "train.seed=-1 must be an integer >= 0"),
    ("train.steps=abc", "train.steps='abc' must be an integer"),
    ("optimizer.momentum=1.5", "optimizer.momentum=1.5 must be in [0, 1)"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 must be >= 0"),
    ("mesh.data=0", "mesh.data=0 must be a positive integer"),
    ("train.val_fraction=1.5", "train.val_fraction=1.5 must be in (0, 1)"),
])
def test_bad_config_values_are_named(faults, tiny, override, message):
    argv = ["pretrain", "--no-progress", *[a for s in tiny for a in ("--set", s)],
            "--set", "train.steps=1", "--set", override]
    faults.expect_error(argv, message)


def test_numeric_run_dir_is_read_as_a_folder_name(faults):
    assert load_config("tiny", ["run_dir=123"]).run_dir == "123"
    faults.recovered()


@pytest.mark.parametrize("argv, message", [
    (["finetune", "--lr", "-1"], "argument --lr: -1.0 must be > 0"),
    (["finetune", "--steps", "0"], "argument --steps: 0 must be a positive integer"),
    (["finetune", "--seed", "-1"], "argument --seed: -1 must be an integer >= 0"),
    (["quantize", "--layers", "0", "--out", "q"], "argument --layers: 0 must be a positive"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-5"],
     "argument --max-new-tokens: -5 must be a positive integer"),
    (["generate", "--prompt", "hi", "--kv-ratio", "0"], "argument --kv-ratio: 0.0 must be > 0"),
    (["edit", "--edits", "e.jsonl", "--lr", "-0.1"], "argument --lr: -0.1 must be > 0"),
])
def test_bad_cli_numbers_are_refused_when_parsed(faults, argv, message):
    faults.expect_error(argv, message)


def test_xkv_past_the_context_is_refused(faults, monkeypatch):
    from flax import nnx

    from lowrank_jax.models import Llama, LlamaConfig
    from lowrank_jax.models.tokenizer import ByteTokenizer

    model = Llama(LlamaConfig(d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32,
                              max_seq_len=32), rngs=nnx.Rngs(0))
    monkeypatch.setattr("lowrank_jax.hub.load_model",
                        lambda *a, **k: (model, ByteTokenizer()))
    faults.expect_error(["generate", "--model", "tiny", "--kv", "xkv", "--prompt", "hello",
                         "--max-new-tokens", "40"],
                        "--max-new-tokens 40 + 5 prompt tokens exceed the model's context (32)")


@pytest.fixture
def adapter(tmp_path):
    from flax import nnx

    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.models import Llama, LlamaConfig
    from lowrank_jax.nn import apply_lora

    cfg = LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    apply_lora(model, {"q_proj": 2}, rngs=nnx.Rngs(1))
    folder = tmp_path / "adapter"
    export_peft(model, folder)
    return folder, lambda: Llama(cfg, rngs=nnx.Rngs(0))


def test_adapter_with_nan_weights_is_refused(faults, adapter):
    from safetensors.numpy import load_file, save_file

    from lowrank_jax.io.peft import import_peft

    folder, fresh = adapter
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = min(tensors)
    tensors[key] = np.full_like(tensors[key], np.nan)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{key}' holds NaN or inf values"):
        import_peft(fresh(), folder)
    faults.clear_error()


@pytest.mark.parametrize("edit, message", [
    (lambda text: text[:-20], "adapter_config.json is not valid JSON"),
    (lambda text: json.dumps({**json.loads(text), "lora_alpha": "sixteen"}),
     "adapter_config.json: lora_alpha='sixteen' must be a positive number"),
    (lambda text: json.dumps({**json.loads(text), "r": 0}),
     "adapter_config.json: r=0 must be a positive integer"),
])
def test_bad_adapter_config_names_file_and_key(faults, adapter, edit, message):
    from lowrank_jax.io.peft import import_peft

    folder, fresh = adapter
    config = folder / "adapter_config.json"
    config.write_text(edit(config.read_text()))
    with pytest.raises(ValueError, match=str(folder).replace("\\", "\\\\")) as info:
        import_peft(fresh(), folder)
    assert message in str(info.value)
    faults.clear_error()
