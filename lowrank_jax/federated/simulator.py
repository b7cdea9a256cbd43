"""A federated LoRA simulator: heterogeneous clients, vmapped or sequential local training,
per-round orbax checkpoints (a long simulation resumes), a tqdm bar over the rounds.

The model is any NNX classifier ``x [b, ...] -> logits [b, classes]`` — or a language model
``tokens [b, t] -> logits [b, t, vocab]`` (a model returning ``(logits, cache)``, like
:class:`lowrank_jax.models.Llama`, is read by its first output; clients of token windows come from
:func:`token_window_client`) — whose adapted layers are
:class:`lowrank_jax.nn.LoRALinear` (added with :func:`lowrank_jax.nn.apply_lora`), all at the same
stored rank ``r``. Only the adapters train; the base is frozen. Each round:

1. ``participation · N`` clients are drawn (seeded by ``(seed, round)``);
2. the strategy dispatches each one a starting adapter and a per-component train mask;
3. each trains ``local_steps`` optimizer steps (a fresh optimizer state every round) on batches
   drawn from its own data by ``(seed, round, client)`` — so a resumed run sees the same batches;
   clients run as one ``jax.vmap`` job (all adapters share the stored rank, lower ranks are zero
   padded) or one after another;
4. the strategy aggregates; the global and the personalised models are evaluated on every
   client's test set (pooled accuracy and cross-entropy).
"""

from __future__ import annotations

import dataclasses
import pathlib
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.core.losses import token_nll
from lowrank_jax.core.step import make_step, scan_steps
from lowrank_jax.federated.fedhera import rank_costs
from lowrank_jax.nn import lora_layers

#: The columns of :attr:`FederatedResult.history`, one row per round.
METRICS = ("round", "global_accuracy", "global_loss", "personal_accuracy", "personal_loss",
           "train_loss", "bytes_down")


@dataclasses.dataclass(frozen=True)
class Client:
    """One client: its data and its budgets, in rank columns per layer.

    ``train_rank`` is what its memory / compute allows it to train (FedHera's ``r_main`` target);
    ``download_rank`` what its bandwidth allows it to receive (``r_tot`` target).
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    train_rank: int = 8
    download_rank: int = 8
    tier: str = "default"

    def __post_init__(self):
        if len(self.train_x) != len(self.train_y) or len(self.train_y) == 0:
            raise ValueError(f"Client: train_x ({len(self.train_x)}) and train_y "
                             f"({len(self.train_y)}) must have the same, non-zero length.")
        if len(self.test_x) != len(self.test_y) or len(self.test_y) == 0:
            raise ValueError("Client: test_x and test_y must have the same, non-zero length.")
        if self.train_rank < 1 or self.download_rank < 1:
            raise ValueError(f"Client: train_rank={self.train_rank} and download_rank="
                             f"{self.download_rank} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class FederationContext:
    """What strategies may read: the clients, the adapted layers and their costs."""

    clients: tuple
    layers: tuple
    shapes: dict  # {layer: (d_in, d_out)}
    stored_rank: int
    scaling: dict  # {layer: LoRA scale}
    weights: np.ndarray  # [N] training-set sizes
    bytes_per_rank: dict
    memory_per_rank: dict
    time_per_rank: dict

    @property
    def n_clients(self) -> int:
        return len(self.clients)

    def a_shape(self, layer):
        return (self.shapes[layer][0], self.stored_rank)

    def b_shape(self, layer):
        return (self.stored_rank, self.shapes[layer][1])


@dataclasses.dataclass
class FederatedResult:
    """``history``: one dict of :data:`METRICS` per round (the metrics of a round that was not
    evaluated are NaN); ``state``: the strategy's final state; ``client_metrics``: the final
    state's ``global_loss`` / ``global_accuracy`` / ``personal_loss`` / ``personal_accuracy`` of
    every client on its own test set (arrays ``[N]``)."""

    history: list
    state: Any
    context: FederationContext
    strategy: Any
    client_metrics: dict = dataclasses.field(default_factory=dict)

    @property
    def final(self) -> dict:
        return self.history[-1]


def _keys(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.split("/"))


class AdapterModel:
    """Functional view of an NNX model's LoRA adapters: ``{layer: (A, B)}`` in, logits out."""

    def __init__(self, model: nnx.Module):
        layers = lora_layers(model)
        if not layers:
            raise ValueError("the model has no LoRALinear layers; add them with "
                             "lowrank_jax.nn.apply_lora(model, rules, rngs=...).")
        ranks = {m.rank for _, m in layers}
        if len(ranks) != 1:
            raise ValueError("every LoRALinear must have the same stored rank "
                             f"(got {sorted(ranks)});"
                             " give lower client ranks through Client.train_rank instead.")
        self.layers = tuple(p for p, _ in layers)
        self.shapes = {p: (m.in_features, m.out_features) for p, m in layers}
        self.scaling = {p: float(m.scaling) for p, m in layers}
        self.rank = ranks.pop()
        self.graphdef, self.lora_state, self.rest = nnx.split(model, nnx.LoRAParam, ...)

    def initial_adapters(self) -> dict:
        pure = nnx.to_pure_dict(self.lora_state)
        out = {}
        for path in self.layers:
            node = pure
            for key in _keys(path):
                node = node[key]
            out[path] = (np.asarray(node["lora_a"]), np.asarray(node["lora_b"]))
        return out

    def logits(self, adapters, x):
        state = jax.tree.map(lambda v: v, self.lora_state)
        pure = nnx.to_pure_dict(state)
        for path, (a, b) in adapters.items():
            node = pure
            for key in _keys(path):
                node = node[key]
            node["lora_a"], node["lora_b"] = a, b
        nnx.replace_by_pure_dict(state, pure)
        out = nnx.merge(self.graphdef, state, self.rest)(x)
        return out[0] if isinstance(out, (tuple, list)) else out  # (logits, cache) models


def token_window_client(train_windows: np.ndarray, heldout_windows: np.ndarray, **budgets
                        ) -> Client:
    """A language-model :class:`Client` from token windows ``[n, t]``: inputs are the first
    ``t − 1`` tokens of each window, targets the next tokens (``y[:, j] = window[:, j + 1]``), so
    ``loss="cross_entropy"`` trains and scores next-token prediction.

    Example::

        >>> import numpy as np
        >>> c = token_window_client(np.arange(12).reshape(3, 4), np.arange(8).reshape(2, 4))
        >>> c.train_x[0].tolist(), c.train_y[0].tolist()
        ([0, 1, 2], [1, 2, 3])
    """
    train, heldout = np.asarray(train_windows), np.asarray(heldout_windows)
    for name, w in (("train_windows", train), ("heldout_windows", heldout)):
        if w.ndim != 2 or w.shape[1] < 2 or not np.issubdtype(w.dtype, np.integer):
            raise ValueError(f"token_window_client: {name} must be integer token windows "
                             f"[n, t] with t >= 2; got {w.dtype} {w.shape}.")
    return Client(train[:, :-1], train[:, 1:], heldout[:, :-1], heldout[:, 1:], **budgets)


def cross_entropy_and_accuracy(logits, labels, weights):
    """Weighted mean (over examples) cross-entropy (nats) and accuracy of integer ``labels``.

    ``labels`` ``[b]`` (one class per example) or ``[b, t, ...]`` (a sequence of targets per
    example, e.g. next tokens): an example's value is then its mean over positions.
    """
    nll = token_nll(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    per_example = tuple(range(1, labels.ndim))
    nll, correct = nll.mean(axis=per_example), correct.mean(axis=per_example)
    total = jnp.maximum(weights.sum(), 1e-12)
    return (nll * weights).sum() / total, (correct * weights).sum() / total


def squared_error(outputs, targets, weights):
    """Weighted mean (over examples) of the squared error summed over outputs; accuracy NaN."""
    err = jnp.sum((outputs.astype(jnp.float32) - targets) ** 2, axis=-1)
    total = jnp.maximum(weights.sum(), 1e-12)
    return (err * weights).sum() / total, jnp.full((), jnp.nan)


OBJECTIVES = {"cross_entropy": cross_entropy_and_accuracy, "mse": squared_error}


def client_batches(client: Client, *, seed: int, round_index: int, client_index: int,
                   steps: int, batch_size: int):
    """The local batches of one client in one round: ``(x [steps, b, ...], y [steps, b])``,
    drawn with replacement by a generator seeded by ``(seed, round, client)``."""
    rng = np.random.default_rng([seed, round_index, client_index])
    idx = rng.integers(0, len(client.train_y), size=(steps, batch_size))
    return client.train_x[idx], client.train_y[idx]


def select_clients(n_clients: int, participation: float, seed: int, round_index: int):
    """Sorted indices of the ``max(1, round(participation · N))`` clients of a round."""
    if not 0.0 < participation <= 1.0:
        raise ValueError(f"participation={participation} must lie in (0, 1].")
    m = max(1, round(participation * n_clients))
    if m == n_clients:
        return np.arange(n_clients)
    rng = np.random.default_rng([seed, round_index, 1_000_003])
    return np.sort(rng.choice(n_clients, m, replace=False))


def make_local_train(adapter_model: AdapterModel, optimizer: optax.GradientTransformation,
                     loss: str = "cross_entropy"):
    """``(adapters, masks, xs [E, b, ...], ys [E, b, ...]) -> (adapters, mean loss)`` for one
    client (``loss``: ``"cross_entropy"`` on integer labels or ``"mse"`` on float targets).

    Gradients and updates are multiplied by the masks (``[r]`` per layer: 1 trains, 0 freezes),
    so a frozen component never moves, even under decoupled weight decay.
    """
    objective = OBJECTIVES[loss]

    def loss_fn(adapters, x, y):
        logits = adapter_model.logits(adapters, x)
        return objective(logits, y, jnp.ones(y.shape[:1], jnp.float32))[0]

    def apply_mask(tree, masks):
        return {k: (ga * masks[k][None, :], gb * masks[k][:, None]) for k, (ga, gb) in tree.items()}

    def local_train(adapters, masks, xs, ys):
        # the masks are this client's (traced) values: mask the gradient the optimizer sees and
        # the update it returns
        masking = optax.stateless(lambda updates, _: apply_mask(updates, masks))
        tx = optax.chain(masking, optimizer, masking)
        step = make_step(loss_fn, tx, jit=False)  # scanned here, vmapped over clients above
        params, _, losses = scan_steps(step, adapters, tx.init(adapters), (xs, ys))
        return params, losses.mean()

    return local_train


def _pad_tests(clients):
    size = max(len(c.test_y) for c in clients)
    xs, ys, ws = [], [], []
    for c in clients:
        pad = size - len(c.test_y)
        xs.append(np.concatenate([c.test_x, np.zeros((pad,) + c.test_x.shape[1:], c.test_x.dtype)]))
        ys.append(np.concatenate([c.test_y, np.zeros((pad,) + c.test_y.shape[1:], c.test_y.dtype)]))
        ws.append(np.concatenate([np.ones(len(c.test_y)), np.zeros(pad)]).astype(np.float32))
    return np.stack(xs), np.stack(ys), np.stack(ws)


def _context(adapter_model, clients, bytes_per_element):
    costs = rank_costs(adapter_model.shapes, bytes_per_element)
    return FederationContext(
        clients=tuple(clients), layers=adapter_model.layers, shapes=adapter_model.shapes,
        stored_rank=adapter_model.rank, scaling=adapter_model.scaling,
        weights=np.array([len(c.train_y) for c in clients], np.float64),
        bytes_per_rank=costs[0], memory_per_rank=costs[1], time_per_rank=costs[2])


def _checkpoint_manager(directory):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(model, optimizer, execution, loss="cross_entropy"):
    """Jitted train / eval functions, cached per model (its frozen base never changes here), so
    simulating several strategies on one model compiles once."""
    cache = _COMPILED.setdefault(model, {})
    default = not isinstance(optimizer, optax.GradientTransformation)  # ("adam", lr)
    key = (optimizer if default else id(optimizer), execution, loss)
    if key not in cache:
        adapter_model = AdapterModel(model)
        tx = optax.adam(optimizer[1]) if default else optimizer
        local_train = make_local_train(adapter_model, tx, loss)
        objective = OBJECTIVES[loss]

        def evaluate(adapters, x, y, w):
            logits = adapter_model.logits(adapters, x)
            value, acc = objective(logits, y, w)
            return value * w.sum(), acc * w.sum()

        cache[key] = (adapter_model,
                      jax.jit(jax.vmap(local_train) if execution == "vmap" else local_train),
                      jax.jit(jax.vmap(evaluate, in_axes=(None, 0, 0, 0))),
                      jax.jit(jax.vmap(evaluate)))
    return cache[key]


def simulate(model: nnx.Module, clients: Sequence[Client], strategy, *, rounds: int = 20,
             local_steps: int = 5, batch_size: int = 32, learning_rate: float = 1e-2,
             optimizer: optax.GradientTransformation | None = None, participation: float = 1.0,
             seed: int = 0, execution: str = "vmap", checkpoint_dir: str | None = None,
             bytes_per_element: float = 2.0, loss: str = "cross_entropy", progress: bool = True,
             description: str | None = None, eval_every: int = 1) -> FederatedResult:
    """Run a federated LoRA simulation and return its per-round history.

    Example::

        >>> import numpy as np
        >>> from flax import nnx
        >>> from lowrank_jax.nn import apply_lora, LoRARule
        >>> from lowrank_jax.federated import Client, FedAvgLoRA, simulate
        >>> class Head(nnx.Module):
        ...     def __init__(self, rngs): self.out = nnx.Linear(4, 3, rngs=rngs)
        ...     def __call__(self, x): return self.out(x)
        >>> model = Head(nnx.Rngs(0)); _ = apply_lora(model, LoRARule("out", rank=2),
        ...                                            rngs=nnx.Rngs(1))
        >>> x = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
        >>> y = (x[:, 0] > 0).astype(np.int32)
        >>> result = simulate(model, [Client(x, y, x, y)] * 2, FedAvgLoRA(), rounds=2,
        ...                   progress=False)
        >>> len(result.history)
        2

    Args:
        model: NNX classifier with :class:`~lowrank_jax.nn.LoRALinear` layers (one stored rank).
        clients: the :class:`Client` list.
        strategy: a strategy from :mod:`lowrank_jax.federated.strategies`.
        rounds, local_steps, batch_size: the schedule (``local_steps`` steps per round).
        learning_rate: Adam's step size when ``optimizer`` is not given.
        optimizer: any optax transformation for the local steps (re-initialised every round).
        participation: fraction of clients per round.
        seed: drives client selection and batches.
        execution: ``"vmap"`` (all participants as one batched job) or ``"sequential"``.
        checkpoint_dir: save an orbax checkpoint every round there, and resume from the latest.
        bytes_per_element: for the download accounting (fp16 = 2).
        loss: ``"cross_entropy"`` (integer labels ``[n]``, or token targets ``[n, t]`` of a
            language model: see :func:`token_window_client`; accuracy reported) or ``"mse"``
            (float targets ``[n, outputs]``; the ``*_loss`` metrics are squared errors,
            accuracies NaN).
        progress: show a tqdm bar over the rounds.
        eval_every: evaluate the global and personalised models every ``eval_every`` rounds
            and after the last (the other rounds' accuracy / loss metrics are NaN): evaluation
            of a large model costs as much as a round of training.

    Returns:
        A :class:`FederatedResult`.
    """
    from tqdm.auto import tqdm

    if loss not in OBJECTIVES:
        raise ValueError(f"loss={loss!r}: use one of {sorted(OBJECTIVES)}.")
    if execution not in ("vmap", "sequential"):
        raise ValueError(f"execution={execution!r}: use 'vmap' or 'sequential'.")
    for key, value in (("rounds", rounds), ("local_steps", local_steps),
                       ("batch_size", batch_size), ("eval_every", eval_every)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{key}={value!r} must be a positive integer.")
    if not clients:
        raise ValueError("clients is empty; give at least one Client.")
    adapter_model, train_fn, eval_global, eval_personal = _compiled(
        model, ("adam", float(learning_rate)) if optimizer is None else optimizer, execution, loss)
    ctx = _context(adapter_model, clients, bytes_per_element)
    classes = int(jax.eval_shape(adapter_model.logits, adapter_model.initial_adapters(),
                                 clients[0].test_x[:1]).shape[-1])
    for i, c in enumerate(clients):
        if loss == "mse":
            if c.train_y.shape[1:] != (classes,) or c.test_y.shape[1:] != (classes,):
                raise ValueError(f"client {i}: mse targets must be [n, {classes}] (the model's "
                                 f"outputs); got {c.train_y.shape} / {c.test_y.shape}.")
            continue
        if not np.issubdtype(c.train_y.dtype, np.integer):
            raise ValueError(f"client {i}: cross_entropy needs integer labels (got "
                             f"{c.train_y.dtype}); use loss='mse' for float targets.")
        low, high = min(c.train_y.min(), c.test_y.min()), max(c.train_y.max(), c.test_y.max())
        if low < 0 or high >= classes:
            raise ValueError(f"client {i}: labels span [{low}, {high}] but the model has "
                             f"{classes} outputs; give labels in [0, {classes}).")
    test_x, test_y, test_w = _pad_tests(clients)
    n_test = test_w.sum()
    per_client = test_w.sum(1)

    def evaluate(state):
        g_loss, g_acc = eval_global(strategy.global_adapters(ctx, state), test_x, test_y, test_w)
        p_loss, p_acc = eval_personal(strategy.personal_adapters(ctx, state), test_x, test_y,
                                      test_w)
        sums = {"global_loss": g_loss, "global_accuracy": g_acc, "personal_loss": p_loss,
                "personal_accuracy": p_acc}
        return ({k: float(np.sum(v) / n_test) for k, v in sums.items()},
                {k: np.asarray(v) / per_client for k, v in sums.items()})

    client_metrics: dict = {}

    state = strategy.init(ctx, AdapterModel(model).initial_adapters())  # current adapters
    history: list = []
    start = 0
    manager = None
    if checkpoint_dir is not None:
        import orbax.checkpoint as ocp

        manager = _checkpoint_manager(checkpoint_dir)
        latest = manager.latest_step()
        if latest is not None:
            leaves, treedef = jax.tree.flatten(state)
            abstract = {"leaves": [jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                                   for v in leaves],
                        "history": jax.ShapeDtypeStruct((latest + 1, len(METRICS)), np.float64)}
            restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
            state = jax.tree.unflatten(treedef, [np.asarray(v) for v in restored["leaves"]])
            history = [dict(zip(METRICS, map(float, row))) for row in restored["history"]]
            start = latest + 1

    bar = tqdm(total=rounds, initial=start, disable=not progress,
               desc=description or getattr(strategy, "name", "federate"), unit="round")
    for t in range(start, rounds):
        participants = select_clients(ctx.n_clients, participation, seed, t)
        sent, masks, sent_bytes, state = strategy.dispatch(ctx, state, t, participants)
        batches = [client_batches(clients[i], seed=seed, round_index=t, client_index=int(i),
                                  steps=local_steps, batch_size=batch_size) for i in participants]
        if execution == "vmap":
            xs = np.stack([b[0] for b in batches])
            ys = np.stack([b[1] for b in batches])
            uploads, losses = train_fn(sent, masks, xs, ys)
        else:
            outs = []
            for j in range(len(participants)):
                one = {k: (a[j], b[j]) for k, (a, b) in sent.items()}
                outs.append(train_fn(one, {k: m[j] for k, m in masks.items()}, *batches[j]))
            uploads = {k: (np.stack([o[0][k][0] for o in outs]),
                           np.stack([o[0][k][1] for o in outs])) for k in ctx.layers}
            losses = np.array([o[1] for o in outs])
        uploads = {k: (np.asarray(a), np.asarray(b)) for k, (a, b) in uploads.items()}
        finite = np.all([np.isfinite(x).reshape(len(participants), -1).all(1)
                         for pair in uploads.values() for x in pair], axis=0)
        if not finite.all():
            raise FloatingPointError(
                f"round {t}: clients {participants[~finite].tolist()} returned non-finite "
                "adapters (local training diverged); lower learning_rate or local_steps.")
        state = strategy.aggregate(ctx, state, t, participants, uploads)
        if (t + 1) % eval_every == 0 or t == rounds - 1:
            pooled, client_metrics = evaluate(state)
        else:
            pooled, client_metrics = dict.fromkeys(METRICS[1:5], float("nan")), {}
        row = {"round": float(t), **pooled, "train_loss": float(np.mean(losses)),
               "bytes_down": float(sent_bytes)}
        history.append(row)
        if manager is not None:
            manager.save(t, args=ocp.args.StandardSave({
                "leaves": [np.asarray(v) for v in jax.tree.leaves(state)],
                "history": np.array([[r[m] for m in METRICS] for r in history], np.float64)}))
            manager.wait_until_finished()
        bar.update(1)
        bar.set_postfix(acc=f"{row['global_accuracy']:.3f}", pacc=f"{row['personal_accuracy']:.3f}")
    bar.close()
    if not client_metrics:  # resumed after the last round
        client_metrics = evaluate(state)[1]
    return FederatedResult(history=history, state=state, context=ctx, strategy=strategy,
                           client_metrics=client_metrics)
