"""The editing application (lowrank_jax.editing): inputs, and CrispEdit's projected updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax import editing as ed
from lowrank_jax.curvature import kfac
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.models.tokenizer import ByteTokenizer
from lowrank_jax.optim import crispedit as ce


def test_edit_inputs_are_validated():
    edits = ed.parse_edits(['{"prompt": "a b", "target": " c", "paraphrases": ["b a"]}', ""])
    assert edits == [ed.EditRequest("a b", " c", ("b a",))]
    with pytest.raises(ValueError, match=":1: each line must be"):
        ed.parse_edits(['{"prompt": 3}'])
    with pytest.raises(ValueError, match="target='' .* tokenises to nothing"):
        ed.tokenize_edits(ByteTokenizer(), ["x"], [""])
    for gamma in (0.0, 1.2):
        with pytest.raises(ValueError, match="gamma="):
            ed.EditConfig(gamma=gamma)
    batch = ed.tokenize_edits(ByteTokenizer(), ["ab", "abcd"], ["X", "YZ"])
    np.testing.assert_array_equal(batch.target_mask, [[0, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(batch.labels[1, 3:], [ord("Y"), ord("Z")])


def test_crispedit_run_on_tiny_llama():
    cfg = LlamaConfig(vocab_size=256, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tok = ByteTokenizer()
    edits = [ed.EditRequest("ab", "c", ("ba",)), ed.EditRequest("de", "f", ())]
    cap = [kfac.lm_batch(jax.random.randint(jax.random.key(0), (4, 12), 0, 256))]
    with pytest.raises(ValueError, match="available dense layers"):
        ed.edit_model(model, tok, edits, ed.EditConfig(layers="nope"), capability_batches=cap)
    path = "layers/1/mlp/down_proj"
    before = model.layers[1].mlp.down_proj.kernel[...]
    config = ed.EditConfig(layers=path, steps=4, lr=1e-2, refresh_threshold=None)
    log = ed.edit_model(model, tok, edits, config, capability_batches=cap)
    assert log["losses"][-1] < log["losses"][0]
    delta = model.layers[1].mlp.down_proj.kernel[...] - before
    assert float(jnp.abs(delta).max()) > 0
    success, prob = ed.edit_scores(model, tok, ["ab", "de"], ["c", "f"])
    assert success.shape == (2,) and np.all((prob > 0) & (prob <= 1))

    # the update lies in the kept (low-curvature) subspace of the projector built from the same
    # capability data, while plain fine-tuning of the same kernel does not
    base = Llama(cfg, rngs=nnx.Rngs(0))
    factors = kfac.estimate_kfac_factors(base, cap, targets=[path])
    projector = ce.build_projector(factors, config.gamma)[path]
    outside = lambda d: float(jnp.linalg.norm(d - ce.project_update(d, projector))
                              / jnp.linalg.norm(d))
    assert outside(delta) < 1e-4
    ed.edit_model(base, tok, edits, ed.EditConfig(method="finetune", layers=path, steps=4,
                                                   lr=1e-2), capability_batches=cap)
    plain = base.layers[1].mlp.down_proj.kernel[...] - before
    assert outside(plain) > 0.05


def test_edit_command_writes_a_loadable_model(tmp_path):
    import argparse
    import json

    from lowrank_jax.commands import edit as edit_command
    from lowrank_jax.hub import load_model
    from lowrank_jax.models.presets import preset_model

    edits = tmp_path / "edits.jsonl"
    edits.write_text(json.dumps({"prompt": "ab", "target": "c", "paraphrases": ["ba"]}) + "\n")
    parser = argparse.ArgumentParser()
    edit_command.register(parser.add_subparsers())
    out = tmp_path / "edited"
    args = parser.parse_args(["edit", "--model", "tiny", "--edits", str(edits), "--method",
                              "finetune", "--layers", "layers/1/mlp/down_proj", "--steps", "2",
                              "--lr", "1e-2", "--seq-len", "16", "--capability-seqs", "2",
                              "--held-seqs", "1", "--out", str(out)])
    assert edit_command.run(args) == 0
    assert (out / "edit.json").is_file()
    edited, _ = load_model(str(out))  # the one loading path reads what edit wrote
    base = preset_model("tiny")
    moved = edited.layers[1].mlp.down_proj.kernel[...] - base.layers[1].mlp.down_proj.kernel[...]
    assert float(jnp.abs(moved).max()) > 0  # the edit is in the written weights
    np.testing.assert_array_equal(edited.layers[0].mlp.down_proj.kernel[...],
                                  base.layers[0].mlp.down_proj.kernel[...])
