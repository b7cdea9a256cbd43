"""Quantized QLoRA bases on disk: NF4 (and RTN-4) folders round-trip exactly, and `finetune` /
`generate` / `merge` work from such a folder."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.hub import load_model, save_model
from lowrank_jax.models.llama import Llama, LlamaConfig, projections
from lowrank_jax.quantize.qlora_base import quantize_base
from lowrank_jax.quant.layers import RTNLinear
from lowrank_jax.quant.nf4 import NF4Linear

CFG = LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                  max_seq_len=32)
TOKENS = jnp.asarray(np.arange(12, dtype=np.int32)[None] * 5 % 64)


@pytest.mark.parametrize("method,double_quant,cls", [("nf4", False, NF4Linear),
                                                     ("nf4", True, NF4Linear),
                                                     ("rtn4", False, RTNLinear)])
def test_quantized_base_folder_round_trips_exactly(tmp_path, method, double_quant, cls):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, method, double_quant=double_quant)
    save_model(model, tmp_path / "base")
    manifest = json.loads((tmp_path / "base" / "quantization.json").read_text())
    assert {m["method"] for m in manifest["layers"].values()} == {method[:3]}
    loaded, _ = load_model(str(tmp_path / "base"))
    assert all(isinstance(lin, cls) for _, _, _, lin in projections(loaded))
    for (_, _, _, a), (_, _, _, b) in zip(projections(model), projections(loaded)):
        for x, y in zip(a.weight(), b.weight()):  # codes, scales, absmaxes: bit for bit
            if x is not None and not isinstance(x, (int, str)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(loaded(TOKENS)[0]), np.asarray(model(TOKENS)[0]))


def test_nf4_double_quant_folder_is_smaller(tmp_path):
    sizes = {}
    for dq in (False, True):
        model = Llama(CFG, rngs=nnx.Rngs(0))
        quantize_base(model, "nf4", double_quant=dq)
        save_model(model, tmp_path / str(dq))
        sizes[dq] = (tmp_path / str(dq) / "model.safetensors").stat().st_size
    assert sizes[True] < sizes[False]


@pytest.mark.parametrize("method", ["nf4", pytest.param("rtn4", marks=pytest.mark.slow)])
def test_finetune_generate_and_merge_from_a_saved_quantized_base(tmp_path, method, capsys):
    from lowrank_jax.cli import main

    small = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--rank", "4",
             "--no-progress"]
    base = tmp_path / "base"
    assert main(["finetune", "--model", "tiny", "--quantize", method, "--save-base", str(base),
                 "--out", str(tmp_path / "a")] + small) == 0
    assert main(["finetune", "--model", str(base), "--out", str(tmp_path / "b")] + small) == 0
    first, second = (json.loads((tmp_path / r / "summary.json").read_text())
                     for r in ("a", "b"))
    assert first["memory_bytes"] == second["memory_bytes"]  # the same frozen codes, from disk
    assert second["final_loss"] < 6.0 and second["adapted_modules"] == first["adapted_modules"]
    loaded, _ = load_model(str(base))
    assert {type(lin) for _, _, _, lin in projections(loaded)} == \
        {NF4Linear if method == "nf4" else RTNLinear}
    assert main(["generate", "--model", str(base), "--raw", "--prompt", "ab",
                 "--max-new-tokens", "3"]) == 0
    assert main(["merge", "--model", str(base), "--adapter", str(tmp_path / "b" / "adapter"),
                 "--to", "quantized", "--eval-tokens", "200", "--out", str(tmp_path / "m")]) == 0
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    merged, _ = load_model(report["saved"])  # the re-quantized merge is a folder too
    assert {type(lin) for _, _, _, lin in projections(merged)} == \
        {NF4Linear if method == "nf4" else RTNLinear}
    assert "stopped" in capsys.readouterr().err


def test_save_base_without_quantize_is_a_clear_error(tmp_path, capsys):
    from lowrank_jax.cli import main

    assert main(["finetune", "--model", "tiny", "--save-base", str(tmp_path / "x"), "--steps",
                 "1", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "it needs --quantize" in capsys.readouterr().err
