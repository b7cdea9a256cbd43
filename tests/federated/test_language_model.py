"""The simulator on a language model: a tiny random Llama with LoRA, token-window clients,
next-token cross entropy."""

import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax import federated as fed
from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.federated import fedtreelora as tree_rules
from lowrank_jax.federated.simulator import cross_entropy_and_accuracy
from lowrank_jax.models.presets import preset_model
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers

PATTERN = r"self_attn/(q_proj|v_proj)$"
LENGTH, STEPS, LR = 9, 3, 0.5


def _llama():
    model = preset_model("tiny", seed=0, vocab_size=32, d_model=32, n_heads=2, n_kv_heads=1,
                         d_ff=32)
    apply_lora(model, LoRARule(PATTERN, rank=2), rngs=nnx.Rngs(1))
    return model


def _window(start, step=1):
    return ((start + step * np.arange(LENGTH)) % 32).astype(np.int32)


def test_sequence_cross_entropy_is_the_token_mean():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 5)).astype(np.float32)
    labels = rng.integers(0, 5, size=(3, 4)).astype(np.int32)
    nll, acc = cross_entropy_and_accuracy(logits, labels, np.ones(3, np.float32))
    np.testing.assert_allclose(float(nll), float(cross_entropy(logits, labels)), rtol=1e-6)
    assert float(acc) == pytest.approx(np.mean(logits.argmax(-1) == labels))
    # example weights weigh whole sequences: weight 0 on example 2 = the mean of examples 0, 1
    nll01, _ = cross_entropy_and_accuracy(logits, labels, np.array([1, 1, 0], np.float32))
    np.testing.assert_allclose(float(nll01), float(cross_entropy(logits[:2], labels[:2])),
                               rtol=1e-6)


def test_fedavg_of_identical_clients_equals_one_clients_training():
    """Two clients holding the same single window draw the same batches, so FedAvg-LoRA of them
    equals plain LoRA training of one Llama on that window (SGD, rounds × steps), and the
    reported held-out NLL is that model's next-token cross entropy."""
    train, heldout = _window(0)[None], _window(3, 2)[None]
    client = fed.token_window_client(train, heldout)
    rounds = 2
    result = fed.simulate(_llama(), [client, client], fed.FedAvgLoRA(), rounds=rounds,
                          local_steps=STEPS, batch_size=2, optimizer=optax.sgd(LR),
                          eval_every=2, progress=False)

    model = _llama()
    opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.LoRAParam)
    x, y = np.repeat(train[:, :-1], 2, 0), np.repeat(train[:, 1:], 2, 0)

    def loss_fn(m):
        return cross_entropy(m(x)[0], y)

    for _ in range(rounds * STEPS):
        opt.update(model, nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model))
    glob = result.strategy.global_adapters(result.context, result.state)
    moved = 0.0
    for path, m in lora_layers(model):
        np.testing.assert_allclose(glob[path][0], m.lora_a[...], atol=1e-5)
        np.testing.assert_allclose(glob[path][1], m.lora_b[...], atol=1e-5)
        moved += float(np.abs(m.lora_b[...]).sum())
    assert moved > 0  # the adapters did train
    expected = float(cross_entropy(model(heldout[:, :-1])[0], heldout[:, 1:]))
    assert result.final["global_loss"] == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(result.client_metrics["personal_loss"], [expected] * 2, rtol=1e-5)
    assert np.isnan(result.history[0]["global_loss"])  # eval_every=2: round 0 not evaluated
    assert result.history[0]["train_loss"] > result.final["train_loss"]


def test_tree_groups_the_clients_of_one_domain():
    """Four clients, two per domain; a domain is one set of windows (tokens 0–15 or 16–31) that
    both its clients hold (each draws its own batches). After a one-round warm-up the
    B-similarity tree pairs the clients of each domain first, and its 2-group cut is the
    domains."""
    clients = []
    for low in (0, 0, 16, 16):
        windows = np.random.default_rng(low).integers(low, low + 16, (8, LENGTH)).astype(np.int32)
        clients.append(fed.token_window_client(windows, windows[:1]))
    strategy = fed.FedTreeLoRA(warmup_rounds=1, rebuild_every=10)
    result = fed.simulate(_llama(), clients, strategy, rounds=2, local_steps=STEPS, batch_size=8,
                          optimizer=optax.sgd(LR), progress=False)
    tree = result.state["tree"]
    labels = tree_rules.cut(tree, 2)
    np.testing.assert_array_equal(labels, [0, 0, 1, 1])
    # the first merges join the same-domain pairs, the last one the two domains
    assert {frozenset(map(int, tree[i, :2])) for i in range(2)} == {frozenset({0, 1}),
                                                                    frozenset({2, 3})}
    assert tree[2, 2] > max(tree[0, 2], tree[1, 2])
    assert result.client_metrics["personal_accuracy"].shape == (4,)


def test_token_window_client_errors():
    with pytest.raises(ValueError, match="token windows"):
        fed.token_window_client(np.zeros((2, 1), np.int32), np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="token windows"):
        fed.token_window_client(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int32))
