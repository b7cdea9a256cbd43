"""Server strategies for :func:`lowrank_jax.federated.simulate`: FedHera, FedTreeLoRA, baselines.

A strategy is a small object whose whole round-to-round memory is a ``state`` dict of arrays
(so orbax checkpoints it and a simulation resumes). The simulator calls, each round:

* ``dispatch(ctx, state, round, participants) -> (adapters [P], masks [P], bytes, state)``:
  what each participating client starts local training from, which rank components it may train
  (``1`` = trainable, ``0`` = frozen, per layer ``[P, r]``), and the bytes downloaded;
* ``aggregate(ctx, state, round, participants, uploads) -> state`` with the trained adapters;
* ``global_adapters(ctx, state)`` (one adapter set, the server's model) and
  ``personal_adapters(ctx, state)`` (``[N]``: the model each client would use).

Adapters are client-stacked ``{layer: (A [N, d_in, r], B [N, r, d_out])}`` at the stored rank
``r`` of the model's LoRA layers; lower ranks are zero-padded (zero components get no gradient).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lowrank_jax.federated import fedhera as hera
from lowrank_jax.federated import fedtreelora as tree_rules


def _take(adapters, idx):
    return {k: (np.asarray(a)[idx], np.asarray(b)[idx]) for k, (a, b) in adapters.items()}


def _broadcast(single, n):
    return {k: (np.repeat(np.asarray(a)[None], n, 0), np.repeat(np.asarray(b)[None], n, 0))
            for k, (a, b) in single.items()}


def _weighted_mean(adapters, weights):
    p = np.asarray(weights, np.float64) / np.sum(weights)
    return {k: (np.tensordot(p, np.asarray(a), 1).astype(np.float32),
                np.tensordot(p, np.asarray(b), 1).astype(np.float32))
            for k, (a, b) in adapters.items()}


def _prefix(ranks, stored):
    """``[P, stored]`` masks with ones on the first ``ranks[p]`` components."""
    return (np.arange(stored)[None, :] < np.asarray(ranks)[:, None]).astype(np.float32)


def _truncate(adapters, ranks_per_layer):
    """Zero the components beyond ``ranks_per_layer[layer][p]`` (client-stacked)."""
    out = {}
    for k, (a, b) in adapters.items():
        m = _prefix(ranks_per_layer[k], a.shape[-1])
        out[k] = (np.asarray(a) * m[:, None, :], np.asarray(b) * m[:, :, None])
    return out


def _bytes(ctx, ranks_per_layer, factor=1.0):
    return float(sum(np.sum(ranks_per_layer[k]) * ctx.bytes_per_rank[k] * factor
                     for k in ctx.layers))


def _client_ranks(ctx, participants, attr):
    return np.array([min(getattr(ctx.clients[i], attr), ctx.stored_rank) for i in participants])


@dataclasses.dataclass(frozen=True)
class FedAvgLoRA:
    """FedAvg on LoRA factors (A and B averaged separately). ``rank``: every client trains the
    first ``rank`` components (the homogeneous "bucket" baseline: the weakest client's rank);
    ``None`` = the full stored rank."""

    rank: int | None = None
    name: str = "fedavg"

    def init(self, ctx, init):
        return {"global": init}

    def _rank(self, ctx):
        return ctx.stored_rank if self.rank is None else min(self.rank, ctx.stored_rank)

    def dispatch(self, ctx, state, round_index, participants):
        ranks = np.full(len(participants), self._rank(ctx))
        per_layer = {k: ranks for k in ctx.layers}
        sent = _truncate(_broadcast(state["global"], len(participants)), per_layer)
        masks = {k: _prefix(ranks, ctx.stored_rank) for k in ctx.layers}
        return sent, masks, _bytes(ctx, per_layer), state

    def aggregate(self, ctx, state, round_index, participants, uploads):
        return {"global": _weighted_mean(uploads, ctx.weights[participants])}

    def global_adapters(self, ctx, state):
        return state["global"]

    def personal_adapters(self, ctx, state):
        return _broadcast(state["global"], ctx.n_clients)


@dataclasses.dataclass(frozen=True)
class HetLoRA(FedAvgLoRA):
    """HetLoRA-style truncation: client ``i`` trains rank ``r_i`` (its memory budget), the server
    averages the zero-padded factors and sends each client the global truncated to ``r_i``.
    (Data-size weights; HetLoRA's sparsity weighting and self-pruning are not included.)"""

    name: str = "hetlora"

    def dispatch(self, ctx, state, round_index, participants):
        ranks = _client_ranks(ctx, participants, "train_rank")
        per_layer = {k: ranks for k in ctx.layers}
        sent = _truncate(_broadcast(state["global"], len(participants)), per_layer)
        masks = {k: _prefix(ranks, ctx.stored_rank) for k in ctx.layers}
        return sent, masks, _bytes(ctx, per_layer), state


@dataclasses.dataclass(frozen=True)
class FedHera:
    """FedHera: download rank ``r_tot`` (bandwidth) decoupled from trained rank ``r_main``
    (memory / time); see :mod:`lowrank_jax.federated.fedhera`.

    Args:
        unbiased: delta-form aggregation (otherwise the original dense average).
        tail_warmup: Adaptive Tail Warm-up on the frozen tail.
        coupled: ``r_tot = r_main`` (classic truncation: FlexLoRA-style SVD redistribution).
        safety: budget factor over the tier's target ranks (code: 1.1).

    Budgets come from the client's tier: ``download_rank · Σ_l bytes_l · safety`` bytes, and
    ``train_rank · Σ_l cost_l · safety`` of memory and of time; water-filling then spends them
    per layer by spectral energy. Round 0 sends everyone the model's initial adapter, truncated
    to its tier. For the unbiased rule the server remembers, per client, exactly what it sent
    last (after the tail warm-up scaling), so ``D_i − D_i^{init}`` is the local training delta
    alone; a client that skipped rounds is compared with its own last push.
    """

    unbiased: bool = True
    tail_warmup: bool = True
    coupled: bool = False
    safety: float = 1.1
    name: str = "fedhera"

    def init(self, ctx, init):
        n = ctx.n_clients
        return {
            "init": init,
            "dense": {k: np.zeros(ctx.shapes[k], np.float32) for k in ctx.layers},
            "started": np.zeros((), np.int32),
            "received": _broadcast(init, n),
            "alignment": np.zeros(n, np.float32),
            "seen": np.full(n, -1, np.int32),
        }

    def _ranks(self, ctx, sigmas, client):
        total = sum(ctx.bytes_per_rank[k] for k in ctx.layers)
        mem = sum(ctx.memory_per_rank[k] for k in ctx.layers)
        time = sum(ctx.time_per_rank[k] for k in ctx.layers)
        cap = {k: ctx.stored_rank for k in ctx.layers}
        r_main_target = min(client.train_rank, ctx.stored_rank)
        r_tot_target = max(min(client.download_rank, ctx.stored_rank), r_main_target)
        r_tot = hera.water_fill_download(sigmas, ctx.bytes_per_rank,
                                         r_tot_target * total * self.safety, max_rank=cap)
        r_main = hera.water_fill_train(sigmas, r_tot, ctx.memory_per_rank, ctx.time_per_rank,
                                       r_main_target * mem * self.safety,
                                       r_main_target * time * self.safety)
        if self.coupled:
            r_tot = r_main = {k: min(r_tot[k], r_main[k]) for k in ctx.layers}
        return r_tot, r_main

    def dispatch(self, ctx, state, round_index, participants):
        p = len(participants)
        r_tot = {k: np.zeros(p, int) for k in ctx.layers}
        r_main = {k: np.zeros(p, int) for k in ctx.layers}
        sent = {k: (np.zeros((p,) + ctx.a_shape(k), np.float32),
                    np.zeros((p,) + ctx.b_shape(k), np.float32)) for k in ctx.layers}
        if int(state["started"]):
            svd = hera.svd_layers(state["dense"])
            sigmas = {k: np.asarray(s) for k, (_, s, _) in svd.items()}
        else:  # round 0: every client gets the same init, truncated to its tier
            sigmas = None
        for j, i in enumerate(participants):
            client = ctx.clients[i]
            if sigmas is None:
                rm = min(client.train_rank, ctx.stored_rank)
                rt = rm if self.coupled else max(min(client.download_rank, ctx.stored_rank), rm)
                tot, main = ({k: rt for k in ctx.layers}, {k: rm for k in ctx.layers})
            else:
                tot, main = self._ranks(ctx, sigmas, client)
            lam = 1.0
            if self.tail_warmup:
                lam = float(hera.atw_lambda(state["alignment"][i], round_index, state["seen"][i]))
            for k in ctx.layers:
                r_tot[k][j], r_main[k][j] = tot[k], main[k]
                if sigmas is None:
                    keep = (np.arange(ctx.stored_rank) < tot[k]).astype(np.float32)
                    a, b = state["init"][k]
                    a, b = np.asarray(a) * keep[None, :], np.asarray(b) * keep[:, None]
                else:
                    u, s, vh = svd[k]
                    a, b = hera.make_push(u, s, vh, tot[k], ctx.scaling[k], pad_to=ctx.stored_rank)
                if main[k] < tot[k]:
                    a, b = hera.apply_tail_warmup(a, b, main[k], lam)
                sent[k][0][j], sent[k][1][j] = np.asarray(a), np.asarray(b)
        received = {k: (np.array(state["received"][k][0]), np.array(state["received"][k][1]))
                    for k in ctx.layers}
        for k in ctx.layers:
            received[k][0][participants] = sent[k][0]
            received[k][1][participants] = sent[k][1]
        masks = {k: _prefix(r_main[k], ctx.stored_rank) for k in ctx.layers}
        return sent, masks, _bytes(ctx, r_tot), {**state, "received": received}

    def aggregate(self, ctx, state, round_index, participants, uploads):
        weights = ctx.weights[participants]
        if self.unbiased and int(state["started"]):
            dense = hera.merge_dense_unbiased(state["dense"], uploads,
                                              _take(state["received"], participants), weights,
                                              ctx.scaling)
        else:
            dense = hera.merge_dense(uploads, weights, ctx.scaling)
        dense = {k: np.asarray(v, np.float32) for k, v in dense.items()}
        align, seen = np.array(state["alignment"]), np.array(state["seen"])
        for j, i in enumerate(participants):
            own = {k: (uploads[k][0][j], uploads[k][1][j]) for k in ctx.layers}
            align[i] = float(hera.alignment(own, dense, ctx.scaling))
            seen[i] = round_index
        return {**state, "dense": dense, "started": np.ones((), np.int32),
                "alignment": align, "seen": seen}

    def global_adapters(self, ctx, state):
        if not int(state["started"]):
            return state["init"]
        svd = hera.svd_layers(state["dense"])
        return {k: tuple(np.asarray(x) for x in hera.make_push(
            u, s, vh, ctx.stored_rank, ctx.scaling[k], pad_to=ctx.stored_rank))
            for k, (u, s, vh) in svd.items()}

    def personal_adapters(self, ctx, state):
        return _broadcast(self.global_adapters(ctx, state), ctx.n_clients)


def FlexLoRA(**kwargs) -> FedHera:
    """FlexLoRA-style SVD redistribution: the dense average, re-split by SVD and sent at each
    client's trainable rank (FedHera's coupled, original-aggregation, no-warm-up ablation)."""
    return FedHera(unbiased=False, tail_warmup=False, coupled=True, name="flexlora", **kwargs)


@dataclasses.dataclass(frozen=True)
class LocalOnly:
    """No aggregation: each client keeps training its own adapter (``k_l = N``)."""

    name: str = "local"

    def init(self, ctx, init):
        return {"clients": _broadcast(init, ctx.n_clients)}

    def dispatch(self, ctx, state, round_index, participants):
        sent = _take(state["clients"], participants)
        masks = {k: np.ones((len(participants), ctx.stored_rank), np.float32) for k in ctx.layers}
        return sent, masks, 0.0, state

    def _store(self, state, participants, uploads):
        clients = {k: (np.array(a), np.array(b)) for k, (a, b) in state["clients"].items()}
        for k, (a, b) in uploads.items():
            clients[k][0][participants] = a
            clients[k][1][participants] = b
        return {**state, "clients": clients}

    def aggregate(self, ctx, state, round_index, participants, uploads):
        return self._store(state, participants, uploads)

    def global_adapters(self, ctx, state):
        return _weighted_mean(state["clients"], ctx.weights)

    def personal_adapters(self, ctx, state):
        return state["clients"]


@dataclasses.dataclass(frozen=True)
class FedSA(LocalOnly):
    """FedSA-LoRA-style personalisation: A is shared (averaged), B stays on each client."""

    name: str = "fedsa"

    def dispatch(self, ctx, state, round_index, participants):
        sent, masks, _, state = super().dispatch(ctx, state, round_index, participants)
        sent_bytes = float(sum(  # only A travels
            len(participants) * ctx.stored_rank * ctx.bytes_per_rank[k] * ctx.shapes[k][0]
            / sum(ctx.shapes[k]) for k in ctx.layers))
        return sent, masks, sent_bytes, state

    def aggregate(self, ctx, state, round_index, participants, uploads):
        state = self._store(state, participants, uploads)
        p = ctx.weights[participants] / ctx.weights[participants].sum()
        clients = {}
        for k, (a, b) in state["clients"].items():
            shared = np.tensordot(p, np.asarray(uploads[k][0]), 1).astype(np.float32)
            clients[k] = (np.repeat(shared[None], ctx.n_clients, 0), b)
        return {**state, "clients": clients}


@dataclasses.dataclass(frozen=True)
class FedTreeLoRA(LocalOnly):
    """FedTreeLoRA: local warm-up, then per-layer group averaging on cuts of one B-similarity
    tree, rebuilt every ``rebuild_every`` rounds (and whenever the participants change).

    ``flat_groups=k`` gives the flat clustered baseline (one cut, ``k_l = k`` for every layer,
    FedLEASE-style one LoRA per cluster)."""

    warmup_rounds: int = 3
    tau: float = 0.5
    rebuild_every: int = 5
    monotone: bool = True
    flat_groups: int | None = None
    name: str = "fedtree"

    def init(self, ctx, init):
        state = super().init(ctx, init)
        n, n_layers = ctx.n_clients, len(ctx.layers)
        return {**state, "tree": np.zeros((max(n - 1, 1), 4)), "built": np.full((), -1, np.int32),
                "members": np.zeros(n, np.int32), "depths": np.zeros(n_layers, np.int32),
                "anchor": {k: np.array(b) for k, (_, b) in state["clients"].items()}}

    def dispatch(self, ctx, state, round_index, participants):
        sent, masks, _, state = super().dispatch(ctx, state, round_index, participants)
        shared = round_index > self.warmup_rounds  # after the first aggregation
        per_layer = {k: np.full(len(participants), ctx.stored_rank * shared) for k in ctx.layers}
        return sent, masks, _bytes(ctx, per_layer), state

    def aggregate(self, ctx, state, round_index, participants, uploads):
        state = self._store(state, participants, uploads)
        if round_index < self.warmup_rounds:
            return state
        # DERIVED: similarity of the B change since the last aggregation (the "anchor"). At the
        # end of the warm-up the anchor is the zero init, so this is B itself (FedLEASE);
        # afterwards it avoids the artefact that already-averaged layers look identical forever.
        updates = {k: (uploads[k][0], uploads[k][1] - state["anchor"][k][participants])
                   for k in ctx.layers}
        members = np.zeros(ctx.n_clients, np.int32)
        members[participants] = 1
        stale = (int(state["built"]) < 0 or round_index - int(state["built"]) >= self.rebuild_every
                 or not np.array_equal(members, state["members"]))
        if stale:
            tree = tree_rules.build_tree(tree_rules.client_distance(updates, ctx.layers))
            if self.flat_groups is not None:
                k = min(self.flat_groups, len(participants))
                depths = {layer: k for layer in ctx.layers}
            else:
                sims = {layer: tree_rules.layer_similarity(updates, layer) for layer in ctx.layers}
                depths = tree_rules.choose_depths(tree, sims, self.tau, monotone=self.monotone)
            padded = np.zeros_like(state["tree"])
            padded[: len(tree)] = tree
            state = {**state, "tree": padded,
                     "built": np.asarray(round_index, np.int32), "members": members,
                     "depths": np.array([depths[k] for k in ctx.layers], np.int32)}
        depths = {k: int(d) for k, d in zip(ctx.layers, state["depths"])}
        tree = state["tree"][: len(participants) - 1]
        merged = tree_rules.aggregate(uploads, ctx.weights[participants], depths, tree)
        state = self._store(state, participants, merged)
        anchor = {k: np.array(b) for k, b in state["anchor"].items()}
        for k in ctx.layers:
            anchor[k][participants] = merged[k][1]
        return {**state, "anchor": anchor}
