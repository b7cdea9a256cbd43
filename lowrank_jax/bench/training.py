"""Training-side benchmarks: Spectron's overhead curve and factorized vs dense at equal width.

Every function returns rows (see :mod:`lowrank_jax.bench.suite`) whose ``time_ratio`` is
``method seconds / baseline seconds``, both measured round-robin in the same process.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.bench.timing import time_interleaved
from lowrank_jax.models.generate import forward, generate, prepare
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.optim import find_pairs, scale_by_spectron, spectron_with_adamw
from lowrank_jax.train.loop import make_lm_step


def row(benchmark: str, case: str, method: str, baseline: str, method_s: float,
        baseline_s: float, *, target: str | None = None, met: bool | None = None,
        **extra) -> dict:
    """One result: ``time_ratio = method_s / baseline_s`` (below 1: the method is faster)."""
    return {"benchmark": benchmark, "case": case, "method": method, "baseline": baseline,
            "method_s": method_s, "baseline_s": baseline_s,
            "time_ratio": method_s / baseline_s, "target": target, "met": met, **extra}


def random_token_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    """``(inputs, targets)``, each ``int32 [batch, seq]``: uniform random ids below ``vocab`` and
    the same ids shifted by one (the next-token targets), from ``jax.random.key(seed)``.

    Example::

        >>> x, y = random_token_batch(256, 2, 5)
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        ((2, 5), True)
    """
    ids = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, vocab, jnp.int32)
    return ids[:, :-1], ids[:, 1:]


def train_step_runner(cfg: LlamaConfig, tx: optax.GradientTransformation, batch: int,
                      seq: int, seed: int = 0):
    """A zero-argument callable that takes one real training step (state carried over)."""
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    graph, state = nnx.split(model)
    params = nnx.as_pure(state)
    holder = [params, tx.init(params)]
    step = make_lm_step(graph, tx)
    x, y = random_token_batch(cfg.vocab_size, batch, seq, seed)

    def run():
        holder[0], holder[1], metrics = step(holder[0], holder[1], x, y)
        return metrics["loss"]

    return run


def spectron_per_pair(eta: float, adamw_lr: float) -> optax.GradientTransformation:
    """:func:`spectron_with_adamw` with the per-pair Python loop (``batch_pairs=False``): the
    "before" of the batched update."""
    return optax.partition(
        {"spectron": optax.chain(scale_by_spectron(batch_pairs=False),
                                 optax.scale_by_learning_rate(eta)),
         "adamw": optax.adamw(adamw_lr, b1=0.9, b2=0.95, weight_decay=0.0)},
        lambda params: find_pairs(params, kinds=("factor",), labels=("spectron", "adamw")))


def update_runner(cfg: LlamaConfig, tx: optax.GradientTransformation, seed: int = 0):
    """A zero-argument callable running only ``tx.update`` + ``apply_updates`` (jitted) on the
    model's parameter tree: the optimizer's own cost, which does not depend on the batch."""
    params = nnx.as_pure(nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))[1])
    grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    holder = [params, tx.init(params)]

    @jax.jit
    def update(params, opt):
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    def run():
        holder[0], holder[1] = update(*holder)
        return holder[0]

    return run


def spectron_overhead(*, quick: bool, reps: int) -> list[dict]:
    """Spectron (+AdamW on the rest) vs AdamW step time on one factorized model, as the
    number of tokens per step grows: the overhead curve (claim: negligible at scale)."""
    if quick:
        cfg_kw, seq, token_counts = dict(d_model=16, d_ff=32, n_heads=2, n_kv_heads=2), 8, [16]
    else:
        cfg_kw, seq = dict(d_model=128, d_ff=512, n_heads=4, n_kv_heads=4), 128
        token_counts = [512, 2048, 8192, 32768]
    cfg = LlamaConfig(vocab_size=64 if quick else 256, n_layers=1 if quick else 2,
                      max_seq_len=seq, projection="factorized", rank_ratio=0.25, **cfg_kw)
    updates = time_interleaved({
        "adamw": update_runner(cfg, optax.adamw(1e-3)),
        "spectron": update_runner(cfg, spectron_with_adamw(0.01, 1e-3)),
        "per_pair": update_runner(cfg, spectron_per_pair(0.01, 1e-3))}, reps=max(reps, 5))
    extra_update = max(0.0, updates["spectron"] - updates["adamw"])
    rows = [row("spectron_overhead", "optimizer update only", "spectron+adamw update",
                "adamw update", updates["spectron"], updates["adamw"], d_model=cfg.d_model),
            row("spectron_overhead", "update only, batched vs loop", "pairs batched (after)",
                "per-pair loop (before)", updates["spectron"], updates["per_pair"],
                d_model=cfg.d_model)]
    for tokens in token_counts:
        batch = max(1, tokens // seq)
        times = time_interleaved({
            "adamw": train_step_runner(cfg, optax.adamw(1e-3), batch, seq),
            "spectron": train_step_runner(cfg, spectron_with_adamw(0.01, 1e-3), batch, seq),
            "per_pair": train_step_runner(cfg, spectron_per_pair(0.01, 1e-3), batch, seq),
        }, reps=reps)
        ratio = times["spectron"] / times["adamw"]
        # The whole step is noisy on a shared machine; its optimizer part is not: the overhead
        # from the update times measured above, relative to this AdamW step.
        from_update = 1.0 + extra_update / times["adamw"]
        big = tokens >= 8192
        rows.append(row("spectron_overhead", f"tokens/step={batch * seq}", "spectron+adamw",
                        "adamw", times["spectron"], times["adamw"],
                        target="<= 1.05 at >= 8k tokens" if big else None,
                        met=bool(ratio <= 1.05) if big else None,
                        d_model=cfg.d_model, rank_ratio=cfg.rank_ratio,
                        step_ratio_from_update_times=from_update))
        rows.append(row("spectron_overhead", f"tokens/step={batch * seq} batched vs loop",
                        "pairs batched (after)", "per-pair loop (before)", times["spectron"],
                        times["per_pair"], d_model=cfg.d_model))
    return rows


def prefill_runner(model: Llama, tokens):
    """A zero-argument callable: one jitted prefill of ``tokens [batch, seq]`` through ``model``
    (no cache), returning the last position's logits ``[batch, vocab]``."""
    static, state = prepare(model)
    run = jax.jit(lambda state, tokens: forward(static, state, tokens)[0][:, -1])
    return lambda: run(state, tokens)


def decode_runners(model: Llama, prompt: list[int], new_tokens: int, tokenizer=None,
                   stepwise: bool = False, **generate_kwargs):
    """Two zero-argument greedy :func:`generate` calls: ``new_tokens`` tokens, and the same call
    stopped at its first token (an end token chosen to be that token: the same shapes, so no
    second compilation).

    Their time difference over ``new_tokens - 1`` is the decode time per token with prefill,
    sampling setup and compilation excluded. ``stepwise=True`` passes a ``stream`` callback,
    which runs one jitted step per token from Python (the path before the compiled loop);
    ``generate_kwargs`` go to :func:`generate` (e.g. ``unroll_decode=False``).
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 (a decode step after prefill).")
    stream = (lambda token, text: None) if stepwise else None
    first = generate(model, tokenizer, prompt, max_new_tokens=new_tokens, stop_at_eos=False,
                     stream=stream, **generate_kwargs).token_ids[0]  # compiles the timed calls

    def call(stop: bool):
        return lambda: generate(model, tokenizer, prompt, max_new_tokens=new_tokens,
                                stop_at_eos=stop, eos_ids=[first], stream=stream,
                                **generate_kwargs).token_ids

    return call(False), call(True)


def decode_interleaved(models: dict[str, Llama], prompt: list[int], new_tokens: int,
                       reps: int, tokenizer=None, stepwise: tuple[str, ...] = ()
                       ) -> dict[str, float]:
    """Per-token decode seconds of each model, all generate calls round-robin (medians):
    ``(t(new_tokens) - t(1)) / (new_tokens - 1)``. Names in ``stepwise`` use the per-token
    Python loop."""
    fns = {}
    for name, model in models.items():
        many, one = decode_runners(model, prompt, new_tokens, tokenizer, name in stepwise)
        fns[(name, "many")], fns[(name, "one")] = many, one
    times = time_interleaved(fns, reps=reps)
    return {name: max(times[(name, "many")] - times[(name, "one")], 1e-9) / (new_tokens - 1)
            for name in models}


def factorized_vs_dense(*, quick: bool, reps: int) -> list[dict]:
    """Factorized models (rank ratios 0.125 / 0.25 / 0.5) vs the dense model of the same width:
    training step, prefill, and decode per token (claim: low rank is cheaper to run)."""
    if quick:
        width, ratios = dict(d_model=16, d_ff=32, n_heads=2, n_kv_heads=2, n_layers=1), [0.25]
        batch, seq, prompt_len, new_tokens = 1, 8, 4, 3
    else:
        width = dict(d_model=512, d_ff=2048, n_heads=8, n_kv_heads=8, n_layers=4)
        ratios, batch, seq, prompt_len, new_tokens = [0.125, 0.25, 0.5], 4, 256, 64, 24
    base = dict(vocab_size=256, max_seq_len=max(seq, prompt_len + new_tokens + 1), **width)
    cfgs = {"dense": LlamaConfig(**base)}
    cfgs |= {f"rank_ratio={r:g}": LlamaConfig(**base, projection="factorized", rank_ratio=r)
             for r in ratios}
    train = time_interleaved({name: train_step_runner(cfg, optax.adamw(1e-3), batch, seq)
                              for name, cfg in cfgs.items()}, reps=reps)
    models = {name: Llama(cfg, rngs=nnx.Rngs(0)) for name, cfg in cfgs.items()}
    x, _ = random_token_batch(base["vocab_size"], batch, seq)
    prefill = time_interleaved({name: prefill_runner(m, x) for name, m in models.items()},
                               reps=reps)
    prompt = [int(t) for t in np.asarray(x[0, :prompt_len])]
    decode = decode_interleaved(models, prompt, new_tokens, reps)
    rows = []
    for name in cfgs:
        if name == "dense":
            continue
        key = name == "rank_ratio=0.25"
        for kind, times, unit in (("train_step", train, f"{batch}x{seq} tokens"),
                                  ("prefill", prefill, f"{batch}x{seq} tokens"),
                                  ("decode", decode, "per token")):
            ratio = times[name] / times["dense"]
            target = "< 1 (faster than dense)" if key and kind != "prefill" else None
            rows.append(row("factorized_vs_dense", f"{kind} {name} ({unit})",
                            f"factorized {name}", "dense", times[name], times["dense"],
                            target=target, met=bool(ratio < 1) if target else None,
                            d_model=width["d_model"], n_layers=width["n_layers"]))
    return rows


__all__ = ["decode_interleaved", "decode_runners", "factorized_vs_dense", "prefill_runner",
           "random_token_batch", "row", "spectron_overhead", "train_step_runner"]
