"""Packed K-job LoRA (PLoRA) vs the same K jobs trained one after another, with a breakdown.

Sequential: K models, each with ``LoRALinear`` adapters (``apply_lora``) and its own jitted
AdamW step. Packed: one model with ``MultiLoRALinear`` (K adapters), one jitted step over the
concatenated batches (:func:`lowrank_jax.train.jobs.make_packed_step`, ``per_job_adamw``). One
round = one step of every job. The packed step's time is split into the frozen base's
forward+backward (gradient reaching the embeddings, no adapters), the optimizer update, the host
dispatch of the step's arguments (a jitted identity over the same trees), and the adapter
matmuls (the rest).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lowrank_jax.bench.timing import time_interleaved
from lowrank_jax.bench.training import _tokens, row
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.nn import LoRARule, apply_lora
from lowrank_jax.nn.multi_lora import apply_multi_lora
from lowrank_jax.train.jobs import make_packed_step
from lowrank_jax.train.losses import cross_entropy
from lowrank_jax.train.multi_job import per_job_adamw

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = (4, 8, 16, 4, 8, 16, 4, 8)


def _sequential_runner(cfg, k_jobs, batch, seq):
    steps = []
    for k in range(k_jobs):
        model = Llama(cfg, rngs=nnx.Rngs(0))
        apply_lora(model, LoRARule(pattern="|".join(TARGETS), rank=RANKS[k % len(RANKS)]),
                   rngs=nnx.Rngs(k + 1))
        graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        tx = optax.adamw(1e-3)
        x, y = _tokens(cfg.vocab_size, batch, seq, seed=k)

        @jax.jit
        def step(lora, opt, graph=graph, rest=rest, tx=tx, x=x, y=y):
            def loss_fn(lora):
                logits, _ = nnx.merge(graph, lora, rest)(x)
                return cross_entropy(logits, y)
            loss, grads = jax.value_and_grad(loss_fn)(lora)
            updates, opt = tx.update(grads, opt, lora)
            return optax.apply_updates(lora, updates), opt, loss

        steps.append([step, lora, tx.init(lora)])

    def run():
        losses = []
        for job in steps:
            job[1], job[2], loss = job[0](job[1], job[2])
            losses.append(loss)
        return losses

    return run


def _packed_parts(cfg, k_jobs, batch, seq, implementation):
    model = Llama(cfg, rngs=nnx.Rngs(0))
    ranks = [RANKS[k % len(RANKS)] for k in range(k_jobs)]
    apply_multi_lora(model, ranks=ranks, targets=TARGETS, rngs=nnx.Rngs(1),
                     implementation=implementation)
    graph, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    tx = per_job_adamw([1e-3] * k_jobs)
    ids = jnp.repeat(jnp.arange(k_jobs), batch)
    step = make_packed_step(graph, rest, ids, tx, k_jobs)
    x, y = _tokens(cfg.vocab_size, batch * k_jobs, seq)
    holder = [lora, tx.init(lora)]

    def run():
        holder[0], holder[1], per_job = step(holder[0], holder[1], x, y)
        return per_job

    return run, holder, tx, x, y


def _breakdown_runners(cfg, holder, tx, x, y):
    base = Llama(cfg, rngs=nnx.Rngs(0))
    graph, embed, rest = nnx.split(base, nnx.PathContains("embed_tokens"), ...)

    @jax.jit
    def base_fwd_bwd(embed):
        return jax.grad(lambda e: cross_entropy(nnx.merge(graph, e, rest)(x)[0], y))(embed)

    @jax.jit
    def optimizer(lora, opt):
        updates, opt = tx.update(lora, opt, lora)
        return optax.apply_updates(lora, updates), opt

    dispatch = jax.jit(lambda lora, opt: jnp.zeros((), jnp.float32))  # argument handling only
    return {"base": lambda: base_fwd_bwd(embed),
            "optimizer": lambda: optimizer(*holder),
            "host": lambda: dispatch(*holder)}


def packed_lora(*, quick: bool, reps: int) -> list[dict]:
    """Packed K-job LoRA step vs K sequential LoRA steps (claim: packing ≥ 2× at K = 8)."""
    if quick:
        cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                          d_ff=32, max_seq_len=8)
        k_jobs, batch, seq, impls = 2, 1, 8, ("gather",)
    else:
        cfg = LlamaConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                          d_ff=512, max_seq_len=64)
        k_jobs, batch, seq, impls = 8, 1, 64, ("gather", "ragged")
    runners = {"sequential": _sequential_runner(cfg, k_jobs, batch, seq)}
    parts = {}
    for impl in impls:
        parts[impl] = _packed_parts(cfg, k_jobs, batch, seq, impl)
        runners[f"packed_{impl}"] = parts[impl][0]
    best = impls[0]
    runners |= {f"part_{k}": fn for k, fn in _breakdown_runners(cfg, *parts[best][1:]).items()}
    times = time_interleaved(runners, reps=reps)
    rows = []
    for impl in impls:
        ratio = times[f"packed_{impl}"] / times["sequential"]
        key = impl == best and k_jobs == 8
        extra = {}
        if impl == best:
            total = times[f"packed_{impl}"]
            parts_s = {k: times[f"part_{k}"] for k in ("base", "optimizer", "host")}
            parts_s["adapters"] = max(0.0, total - sum(parts_s.values()))
            extra = {"breakdown_fraction": {k: v / total for k, v in parts_s.items()}}
        rows.append(row("packed_lora", f"K={k_jobs} batch/job={batch} S={seq} ({impl})",
                        f"packed ({impl})", "sequential", times[f"packed_{impl}"],
                        times["sequential"], target="<= 0.5 (>= 2x)" if key else None,
                        met=bool(ratio <= 0.5) if key else None, jobs=k_jobs, **extra))
    return rows


__all__ = ["packed_lora"]
