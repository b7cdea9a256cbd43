"""train.continual_lora: with no training steps every arm leaves the model as it was, so its
score matrix is the base model's on every row (BWT = FWT = 0)."""

import types

import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.presets import preset_model
from lowrank_jax.train.continual_lora import ContinualLoRAConfig, run_continual_lora
from lowrank_jax.train.losses import window_evaluator


def _model():
    return preset_model("tiny", seed=0, vocab_size=32, d_model=32, n_heads=2, n_kv_heads=1,
                        d_ff=32)


@pytest.mark.parametrize("method", ["lora", "olora"])
def test_no_steps_keep_the_base_models_scores(method):
    rng = np.random.default_rng(0)
    tasks = [types.SimpleNamespace(name=f"t{i}", train=rng.integers(0, 32, (4, 9)),
                                   heldout=rng.integers(0, 32, (2, 9)).astype(np.int32))
             for i in range(2)]
    graphdef, state = nnx.split(_model())
    base = [window_evaluator(graphdef)(state, t.heldout) for t in tasks]
    baseline = {"nll": [b[0] for b in base], "acc": [b[1] for b in base]}
    out = run_continual_lora(_model, method, tasks, seed=0, log=lambda line: None,
                             config=ContinualLoRAConfig(rank=2, steps=0), baseline=baseline)
    np.testing.assert_allclose(out["nll_matrix"], [baseline["nll"]] * 2, rtol=1e-5)
    assert out["bwt"] == pytest.approx(0.0) and out["fwt"] == pytest.approx(0.0)
    assert out["losses"] == [[], []]
