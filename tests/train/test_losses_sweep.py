"""The adapter loss, the window evaluator and the sweep readers, against direct computations."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.nn import LoRARule, apply_lora
from lowrank_jax.train.losses import adapter_loss, window_evaluator
from lowrank_jax.train.sweep import best_runs, moving_average, progress_target, steps_to_target


def _model():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    apply_lora(model, LoRARule("q_proj", rank=2), rngs=nnx.Rngs(1))
    return model


def test_adapter_loss_is_the_models_next_token_loss_plus_the_penalty():
    model = _model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (3, 7)), jnp.int32)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    logits, _ = model(tokens[:, :-1])
    want = float(cross_entropy(logits, tokens[:, 1:]))
    assert np.isclose(float(adapter_loss(graphdef)(lora, rest, tokens)), want, rtol=1e-6)
    penalty = adapter_loss(graphdef, lambda lora, c: c)(lora, rest, tokens, 0.5)
    assert np.isclose(float(penalty), want + 0.5, rtol=1e-6)


def test_window_evaluator_averages_batch_means_of_nll_and_accuracy():
    model = _model()
    windows = np.random.default_rng(1).integers(0, 32, (5, 6)).astype(np.int32)
    graphdef, state = nnx.split(model)
    nll, acc = window_evaluator(graphdef, batch_size=2)(state, windows)
    want_nll, want_acc = [], []
    for i in range(0, 5, 2):  # batches of 2, 2, 1
        t = jnp.asarray(windows[i:i + 2])
        logits, _ = model(t[:, :-1])
        want_nll.append(float(cross_entropy(logits, t[:, 1:])))
        want_acc.append(float(jnp.mean(jnp.argmax(logits, -1) == t[:, 1:])))
    assert np.isclose(nll, np.mean(want_nll), rtol=1e-5)
    assert np.isclose(acc, np.mean(want_acc))


def test_sweep_readers():
    runs = [{"method": "a", "lr": 1, "final": 2.0}, {"method": "a", "lr": 2, "final": 2.0},
            {"method": "a", "lr": 3, "final": float("inf")}, {"method": "b", "lr": 1, "final": 1.0}]
    best = best_runs(runs)
    assert best["a"]["lr"] == 1 and best["b"]["lr"] == 1  # ties keep the first; inf never wins
    assert np.isclose(progress_target(4.0, 2.0, fraction=0.5), 3.0)
    assert steps_to_target([(0, 4.0), (3, 3.0), (6, 2.0)], 3.0) == 3
    assert steps_to_target([(0, 4.0)], 3.0) is None
    np.testing.assert_allclose(moving_average([0, 2, 4, 6, 8], 3), [2.0, 4.0, 6.0])



def test_lm_loss_merges_a_split_and_the_scaled_adapter_loss_scales_lora_a():
    from lowrank_jax.train.losses import lm_loss, scale_lora_a, scaled_adapter_loss

    model = _model()
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 6)), jnp.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(lambda v: v + 0.1, lora)  # B != 0: the adapter changes the output
    want = float(lm_loss(graphdef)((lora, rest), x, y))
    nnx.update(model, lora)
    assert np.isclose(want, float(cross_entropy(model(x)[0], y)), rtol=1e-6)
    # s = 3 on lora_a is the merged model with 3 * A
    nnx.update(model, scale_lora_a(lora, 3.0))
    scaled = float(scaled_adapter_loss(graphdef)(lora, x, y, 3.0, rest))
    assert np.isclose(scaled, float(cross_entropy(model(x)[0], y)), rtol=1e-6)
    assert not np.isclose(scaled, want)


def test_evaluate_on_corpus_batches_is_the_mean_of_the_batch_losses():
    from lowrank_jax.data import eval_batches
    from lowrank_jax.train.loop import evaluate
    from lowrank_jax.train.losses import evaluate_windows

    tokens = np.arange(40) % 7
    eval_fn = lambda p, x, y: jnp.mean((p * x - y) ** 2.0)  # noqa: E731
    want = np.mean([float(eval_fn(0.5, x, y)) for x, y in eval_batches(tokens, 2, 4, 3)])
    assert np.isclose(evaluate(eval_fn, 0.5, tokens, 2, 4, 3), want, rtol=1e-6)
    assert evaluate_windows(lambda s, w: w.sum(), (), np.ones(5), batch_size=2) == 5 / 3
