"""CSPLoRA planning: weights, saliency by hand, allocation under a parameter budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.nn import apply_lora, lora_layers
from lowrank_jax.nn.rank_plan import (
    allocate_ranks,
    calibrate_and_smooth,
    per_sample_loss_and_confidence,
    plan_ranks,
    probe_importance,
    sample_weights,
    uniform_budget,
)


def test_sample_weights_properties():
    d = jnp.array([0.1, 0.5, 0.9, 0.3])
    w = sample_weights(d, gamma=2.0)
    assert abs(float(w.sum()) - 1.0) < 1e-6
    assert list(np.argsort(np.asarray(w))) == list(np.argsort(np.asarray(d)))
    np.testing.assert_allclose(sample_weights(d, gamma=0.0), 0.25, atol=1e-7)
    np.testing.assert_allclose(sample_weights(jnp.full(4, 0.3), strategy="adaptive"), 0.25)


def test_saliency_matches_hand_computation():
    cfg = LlamaConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=16)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    x = (jnp.arange(12, dtype=jnp.int32).reshape(2, 6) * 7) % 32
    y = (x + 1) % 32
    scores = probe_importance(model, [(x, y)], targets="up_proj", gamma=0.0)

    graphdef, params = nnx.split(model)

    def loss(params):
        losses, _ = per_sample_loss_and_confidence(nnx.merge(graphdef, params)(x)[0], y)
        return losses.mean()

    grads = jax.jit(jax.grad(loss))(params)
    g = grads["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    w = model.layers[0].mlp.up_proj.kernel[...]
    np.testing.assert_allclose(scores["layers/0/mlp/up_proj"], float(jnp.abs(w * g).sum()),
                               rtol=1e-4)


def test_allocation_respects_budget_bounds_and_order():
    shapes = {f"l{i}": (16, 24) for i in range(5)}
    importance = {"l0": 3.0, "l1": 1.0, "l2": 2.0, "l3": 0.5, "l4": 1.0}
    budget = uniform_budget(shapes, 4)
    ranks = allocate_ranks(importance, budget, shapes, r_min=1, r_max=12)
    assert sum(r * 40 for r in ranks.values()) <= budget
    assert sum(ranks.values()) == 20  # budget met exactly when r_max does not bind
    assert all(1 <= r <= 12 for r in ranks.values())
    assert ranks["l0"] >= ranks["l2"] >= ranks["l1"] >= ranks["l3"]
    equal = allocate_ranks({k: 1.0 for k in shapes}, budget, shapes, r_min=1)
    assert set(equal.values()) == {4}


def test_mixed_shapes_never_exceed_budget():
    shapes = {"q": (64, 64), "up": (64, 160), "down": (160, 64)}
    importance = {"q": 0.2, "up": 1.3, "down": 0.9}
    for budget in (2 * 128 + 4 * 224, 3000, 9000):
        ranks = allocate_ranks(importance, budget, shapes, r_min=2)
        assert sum(ranks[p] * sum(shapes[p]) for p in shapes) <= budget


def test_over_budget_error_names_budget_and_minimum():
    shapes = {"a": (8, 8), "b": (8, 8)}
    with pytest.raises(ValueError, match=r"budget_params=40 is below the minimum 64"):
        allocate_ranks({"a": 1.0, "b": 1.0}, 40, shapes, r_min=2)


def test_smoothing_keeps_order_and_calibrates():
    s = calibrate_and_smooth({"0/q": 1.0, "1/q": 9.0, "0/v": 100.0, "1/v": 100.0})
    assert s["1/q"] > s["0/q"]
    assert s["0/v"] == pytest.approx(np.log(2.0))
    assert s["1/q"] / s["0/q"] < 9.0


def test_plan_feeds_apply_lora():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    x = (jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 3) % 32
    plan, _ = plan_ranks(model, [(x, (x + 1) % 32)], targets="(q|v)_proj", average_rank=4,
                         r_min=1)
    assert sum(r * 32 for r in plan.values()) <= uniform_budget({p: (16, 16) for p in plan}, 4)
    apply_lora(model, "(q|v)_proj", rngs=nnx.Rngs(1), ranks=plan)
    assert {p: m.rank for p, m in lora_layers(model)} == plan
