"""The simulator: one client equals centralized LoRA training, vmap == sequential, resume."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax import federated as fed
from lowrank_jax.federated import fedhera as hera
from lowrank_jax.federated.tasks import make_topic_clients, topic_model
from lowrank_jax.nn import lora_layers

ROUNDS, STEPS, BATCH, LR = 3, 4, 8, 0.05


def _model(classes=3):
    return topic_model(features=8, hidden=6, classes=classes, depth=2, rank=3, seed=0)


def _client(seed=0, n=40, **ranks):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    return fed.Client(x[: n // 2], y[: n // 2], x[n // 2:], y[n // 2:], **ranks)


def _centralized(client, rounds):
    """Plain LoRA training with nnx.Optimizer on the same batch sequence."""
    model = _model()
    opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.LoRAParam)

    def loss_fn(m, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    for t in range(rounds):
        xs, ys = fed.client_batches(client, seed=0, round_index=t, client_index=0, steps=STEPS,
                                    batch_size=BATCH)
        for x, y in zip(xs, ys):
            grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, x, y)
            opt.update(model, grads)
    return {p: (np.asarray(m.lora_a[...]), np.asarray(m.lora_b[...]))
            for p, m in lora_layers(model)}


class Recorder:
    """Wraps a strategy and keeps the uploads it aggregates."""

    def __init__(self, inner):
        self.inner, self.uploads, self.name = inner, [], inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def aggregate(self, ctx, state, round_index, participants, uploads):
        self.uploads.append(uploads)
        return self.inner.aggregate(ctx, state, round_index, participants, uploads)


FACTOR_PRESERVING = [fed.FedAvgLoRA(), fed.HetLoRA(), fed.FedSA(), fed.LocalOnly(),
                     fed.FedTreeLoRA(warmup_rounds=1, rebuild_every=1),
                     fed.FedTreeLoRA(warmup_rounds=0, flat_groups=3)]


@pytest.mark.parametrize("strategy", FACTOR_PRESERVING, ids=lambda s: f"{s.name}")
def test_one_client_equals_centralized_training(strategy):
    client = _client(train_rank=3, download_rank=3)
    result = fed.simulate(_model(), [client], strategy, rounds=ROUNDS, local_steps=STEPS,
                          batch_size=BATCH, optimizer=optax.sgd(LR), progress=False)
    expected = _centralized(client, ROUNDS)
    personal = result.strategy.personal_adapters(result.context, result.state)
    glob = result.strategy.global_adapters(result.context, result.state)
    for k, (a, b) in expected.items():
        np.testing.assert_allclose(personal[k][0][0], a, atol=1e-5)
        np.testing.assert_allclose(personal[k][1][0], b, atol=1e-5)
        np.testing.assert_allclose(glob[k][0] @ glob[k][1], a @ b, atol=1e-5)
    assert result.final["global_accuracy"] == result.final["personal_accuracy"]


@pytest.mark.parametrize("strategy", [fed.FedHera(), fed.FedHera(unbiased=False),
                                      fed.FlexLoRA()], ids=["fedhera", "fedhera-orig", "flex"])
def test_one_client_svd_rules_are_lossless(strategy):
    """SVD re-splitting changes the factors but, with one client at full rank, never the model:
    the first round equals centralized training, and every round the server's update is exactly
    the client's trained update."""
    client = _client(train_rank=3, download_rank=3)
    recorder = Recorder(strategy)
    result = fed.simulate(_model(), [client], recorder, rounds=ROUNDS, local_steps=STEPS,
                          batch_size=BATCH, optimizer=optax.sgd(LR), progress=False)
    ctx = result.context
    first = recorder.uploads[0]
    for k, (a, b) in _centralized(client, 1).items():
        np.testing.assert_allclose(first[k][0][0], a, atol=1e-5)
        np.testing.assert_allclose(first[k][1][0], b, atol=1e-5)
    last = recorder.uploads[-1]
    glob = strategy.global_adapters(ctx, result.state)
    for k in ctx.layers:
        trained = ctx.scaling[k] * last[k][0][0] @ last[k][1][0]
        np.testing.assert_allclose(result.state["dense"][k], trained, atol=1e-5)
        np.testing.assert_allclose(ctx.scaling[k] * glob[k][0] @ glob[k][1], trained, atol=1e-5)


def test_vmap_equals_sequential_with_heterogeneous_ranks():
    clients = [_client(i, train_rank=r, download_rank=d) for i, (r, d) in
               enumerate([(1, 2), (2, 3), (1, 3), (3, 3)])]
    runs = [fed.simulate(_model(), clients, fed.FedHera(), rounds=3, local_steps=3, batch_size=8,
                         participation=0.75, execution=e, progress=False)
            for e in ("vmap", "sequential")]
    for x, y in zip(runs[0].history, runs[1].history):
        for key in fed.METRICS:
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5)
    assert runs[0].history[0]["bytes_down"] > 0


def test_coupled_mode_sends_only_trained_ranks():
    clients = [_client(i, train_rank=r, download_rank=3) for i, r in enumerate([1, 2, 3])]
    strategy = fed.FedHera(coupled=True)
    result = fed.simulate(_model(), clients, strategy, rounds=2, local_steps=2, batch_size=8,
                          progress=False)
    sent, masks, coupled_bytes, _ = strategy.dispatch(result.context, result.state, 2,
                                                      np.arange(3))
    decoupled = fed.FedHera().dispatch(result.context, result.state, 2, np.arange(3))
    for k in result.context.layers:
        nonzero = (np.abs(sent[k][0]).sum(1) > 0).sum(-1)
        np.testing.assert_array_equal(nonzero, masks[k].sum(-1))  # r_tot == r_main
        assert np.all(masks[k].sum(-1) <= [1, 2, 3])
        sent_ranks = (np.abs(decoupled[0][k][0]).sum(1) > 0).sum(-1)
        assert np.all(sent_ranks >= decoupled[1][k].sum(-1))
    assert decoupled[2] > coupled_bytes  # the decoupled push downloads more


def test_checkpoint_resume_continues_the_same_run(tmp_path):
    clients, _ = make_topic_clients(3, seed=0, train_per_client=20, test_per_client=10,
                                    features=8)
    kwargs = {"rounds": 4, "local_steps": 2, "batch_size": 8, "progress": False}
    straight = fed.simulate(_model(6), clients, fed.FedHera(), **kwargs)
    fed.simulate(_model(6), clients, fed.FedHera(), **{**kwargs, "rounds": 2},
                 checkpoint_dir=str(tmp_path / "ckpt"))
    resumed = fed.simulate(_model(6), clients, fed.FedHera(), **kwargs,
                           checkpoint_dir=str(tmp_path / "ckpt"))
    assert len(resumed.history) == 4
    assert np.isfinite(resumed.final["global_loss"])
    for x, y in zip(straight.history, resumed.history):
        assert x == pytest.approx(y, rel=1e-5)
    for leaf_x, leaf_y in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_allclose(np.asarray(leaf_x), np.asarray(leaf_y), atol=1e-6)


def test_clear_errors():
    client = _client()
    with pytest.raises(ValueError, match="participation"):
        fed.simulate(_model(), [client], fed.FedAvgLoRA(), rounds=1, participation=0.0,
                     progress=False)
    with pytest.raises(ValueError, match="apply_lora"):
        fed.simulate(nnx.Linear(8, 3, rngs=nnx.Rngs(0)), [client], fed.FedAvgLoRA(), rounds=1,
                     progress=False)
    with pytest.raises(ValueError, match="labels span"):
        fed.simulate(_model(2), [client], fed.FedAvgLoRA(), rounds=1, progress=False)
    with pytest.raises(FloatingPointError, match="non-finite"):
        fed.simulate(_model(), [client], fed.FedAvgLoRA(), rounds=2, local_steps=20,
                     optimizer=optax.sgd(1e6), progress=False)
    with pytest.raises(ValueError, match="train_x"):
        fed.Client(np.zeros((3, 2)), np.zeros(2), np.zeros((1, 2)), np.zeros(1))
    with pytest.raises(ValueError, match="budget"):
        hera.water_fill_download({"w": np.ones(2)}, {"w": 1.0}, -1.0)
