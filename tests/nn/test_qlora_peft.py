"""QLoRA adapters leave as PEFT folders: `finetune --quantize` end to end, and HuggingFace PEFT
on the dequantized base gives our logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.io.peft import export_peft, import_peft
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.nn import apply_lora, lora_layers
from lowrank_jax.nn.merge import dequantize_model
from lowrank_jax.quantize.qlora_base import quantize_base

INSTALL = "pip install torch transformers peft (CPU wheels are enough)"
CFG = LlamaConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128,
                  max_seq_len=32)


def test_finetune_quantize_trains_and_exports_a_smaller_state(tmp_path):
    from lowrank_jax.cli import main

    runs = {}
    for q in (None, "nf4"):
        out = tmp_path / str(q)
        argv = ["finetune", "--model", "tiny", "--steps", "3", "--batch-size", "2",
                "--seq-len", "16", "--rank", "4", "--out", str(out), "--no-progress"]
        assert main(argv + (["--quantize", q] if q else [])) == 0
        runs[q] = json.loads((out / "summary.json").read_text())
        assert (out / "adapter" / "adapter_model.safetensors").exists()
    fp, nf4 = runs[None]["memory_bytes"], runs["nf4"]["memory_bytes"]
    assert nf4["trainable"] == fp["trainable"] > 0  # the same adapters...
    assert nf4["optimizer"] == fp["optimizer"]
    assert nf4["frozen"] < fp["frozen"]  # ...on a base that holds 4-bit codes
    assert runs["nf4"]["quantize"] == "nf4"


def _qlora_adapter_and_dequantized_base(tmp_path):
    """A QLoRA model (NF4 base, non-zero adapters) exported as PEFT, and its base dequantized and
    saved as a HF folder: ``(our logits, tokens, base model)``."""
    from lowrank_jax.hub import save_model

    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, "nf4")
    apply_lora(model, {r"(q|v|up)_proj": 4}, rngs=nnx.Rngs(1))
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(i), layer.lora_b[...].shape)
    export_peft(model, tmp_path / "adapter")
    base = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(base, "nf4")
    assert dequantize_model(base) == 7
    save_model(base, tmp_path / "base")
    tokens = np.arange(10, dtype=np.int32)[None] % 64
    return np.asarray(model(jnp.asarray(tokens))[0]), tokens, base


def test_qlora_adapter_on_the_dequantized_base_gives_our_logits(tmp_path):
    ours, tokens, base = _qlora_adapter_and_dequantized_base(tmp_path)
    import_peft(base, tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(base(jnp.asarray(tokens))[0]), ours, atol=1e-4)


@pytest.mark.hf
def test_qlora_adapter_matches_hf_peft_on_the_dequantized_base(tmp_path):
    try:
        import torch
        import transformers
        from peft import PeftModel
    except ImportError as err:
        raise AssertionError(f"this test needs torch, transformers and peft: {INSTALL}") from err
    ours, tokens, _ = _qlora_adapter_and_dequantized_base(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"),
                                                            torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_merge_command_reports_the_requantization_error(tmp_path, capsys):
    from lowrank_jax.cli import main

    train = ["finetune", "--model", "tiny", "--quantize", "rtn4", "--steps", "2", "--rank", "4",
             "--batch-size", "2", "--seq-len", "16", "--lr", "0.05", "--out",
             str(tmp_path / "ft"), "--no-progress"]
    assert main(train) == 0
    adapter = str(tmp_path / "ft" / "adapter")
    for to in ("fp", "quantized"):
        out = tmp_path / to
        assert main(["merge", "--model", "tiny", "--quantize", "rtn4", "--adapter", adapter,
                     "--to", to, "--eval-tokens", "300", "--out", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["target"] == to and report["saved"]
        if to == "fp":  # exact: the merged model scores the same perplexity
            assert abs(report["ppl_added"]) < 1e-3 * report["ppl_adapter"]
            assert report["layer_error_max"] == 0.0
        else:  # re-quantization is measured, not hidden
            assert report["layer_error_mean"] > 0 and report["ppl_added"] != 0.0
    assert "adapter on its base" in capsys.readouterr().out
