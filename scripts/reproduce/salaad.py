"""Reproduce SALAAD's claim at CPU scale: one run yields models at any parameter budget.

One SALAAD run trains a tiny dense byte-level Llama on the embedded corpus with every 2-D weight
(embedding and all projections) coupled to a sparse + low-rank surrogate ``L + S``
(:func:`lowrank_jax.optim.salaad`). From that single run, :func:`lowrank_jax.optim.hpa_allocate`
materialises models at 30 / 50 / 70 / 100 % of the dense parameter count. Baselines:

* **separately trained** — a natively factorized Llama per budget (rank ratio chosen so its
  parameter count fits the budget; the dense model at 100 %), trained with the *same total
  compute* as the one SALAAD run: the four runs share its steps (``steps / 4`` each);
* **vanilla + post-hoc** — plain AdamW for the same steps as SALAAD, then the same allocator on
  its weights (``L = W``, ``S = 0``: truncated SVD only).

Usage::

    python scripts/reproduce/salaad.py            # ~5 min on 2 shared CPU cores
    python scripts/reproduce/salaad.py --quick    # ~1 min smoke run

Writes ``<out>/results.json`` (default ``runs/reproduce_salaad``) and ``--plot``
(default ``docs/img/salaad_budgets.png``).

References:
    Ma et al., `SALAAD: Sparse And Low-Rank Adaptation via ADMM for Large Language Model
    Inference <https://arxiv.org/abs/2602.00942>`_, ICML 2026.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.data import corpus_bytes, train_val_split
from lowrank_jax.runs.results import markdown_table
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.models.llama import count_params
from lowrank_jax.optim import (
    SalaadConfig,
    apply_surrogate,
    find_salaad_state,
    hpa_allocate,
    salaad,
    salaad_init,
    salaad_stats,
)
from lowrank_jax.core.step import make_step
from lowrank_jax.train.loop import evaluate as lm_evaluate
from lowrank_jax.train.loop import lm_loss, make_eval_fn, train_steps

BUDGETS = (0.3, 0.5, 0.7, 1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/reproduce_salaad")
    p.add_argument("--plot", default="docs/img/salaad_budgets.png")
    p.add_argument("--quick", action="store_true", help="smoke run (~1 minute)")
    p.add_argument("--steps", type=int, default=None, help="steps of the SALAAD run")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    # DERIVED for this scale (the reference's rho=1e-6 and gains are tuned for 60M+ models
    # and thousands of steps): a stronger pull and gains sized to singular values ~0.1-1.
    p.add_argument("--rho", type=float, default=0.005)
    p.add_argument("--rate-rank", type=float, default=0.15)
    p.add_argument("--rate-sparsity", type=float, default=0.05)
    return p.parse_args(argv)


def model_config(projection="dense", rank_ratio=0.25) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                       d_ff=128, max_seq_len=64, projection=projection, rank_ratio=rank_ratio)


def factorized_for_budget(target: int):
    """The largest rank ratio whose factorized model fits ``target`` parameters."""
    best = None
    for ratio in np.linspace(0.02, 1.0, 50):
        cfg = model_config("factorized", float(ratio))
        n = count_params(nnx.eval_shape(lambda cfg=cfg: Llama(cfg, rngs=nnx.Rngs(0))))
        if n <= target:
            best = (cfg, n)
    return best


def main(argv=None):
    args = parse_args(argv)
    steps = args.steps or (40 if args.quick else 200)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_tokens, val_tokens = train_val_split(corpus_bytes(), 0.1)
    graphdef, params0 = nnx.split(Llama(model_config(), rngs=nnx.Rngs(args.seed)), nnx.Param)
    n_total = sum(x.size for x in jax.tree.leaves(params0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(steps // 20, 1), steps,
                                                  end_value=0.1 * args.lr)
    config = SalaadConfig(rate_rank=args.rate_rank, rate_sparsity=args.rate_sparsity,
                          rho=args.rho, kI_alpha=0.02, kD_alpha=0.001, kI_beta=0.002,
                          kD_beta=0.001, pd_start=max(steps // 4, 1), every=2)
    fit = dict(batch_size=args.batch, seq_len=args.seq, seed=args.seed)
    val_loss = functools.partial(lm_evaluate, tokens=val_tokens, batch_size=16, seq_len=args.seq,
                                 max_batches=8)
    eval_fn = make_eval_fn(graphdef)  # one compiled loss for every model of this architecture
    adamw = lambda lr: optax.chain(optax.clip_by_global_norm(1.0),  # noqa: E731
                                   optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.0))

    t0 = time.perf_counter()
    tx = salaad(schedule, config)
    params, opt_state, _ = train_steps(make_step(lm_loss(graphdef), tx), params0,
                                       tx.init(params0), train_tokens, steps=steps, **fit)
    sstate = find_salaad_state(opt_state)
    salaad_seconds = time.perf_counter() - t0
    stats = salaad_stats(params, sstate)
    rows = [{"model": "SALAAD dense X (100 %)", "params": n_total, "fraction": 1.0,
             "val_loss": val_loss(eval_fn, params)}]
    for frac in BUDGETS:
        alloc = hpa_allocate(sstate, n_total, int(frac * n_total))
        surrogate = apply_surrogate(params, sstate, alloc)
        rows.append({"model": "SALAAD surrogate", "fraction": frac, "params": alloc.n_params,
                     "val_loss": val_loss(eval_fn, surrogate)})
        print(f"SALAAD surrogate at {frac:.0%}: {alloc.n_params:,} params, "
              f"val {rows[-1]['val_loss']:.4f}", flush=True)

    # Vanilla AdamW for the same steps, compressed post hoc by the same allocator (L = W, S = 0).
    tx = adamw(schedule)
    vanilla, _, _ = train_steps(make_step(lm_loss(graphdef), tx), params0, tx.init(params0),
                                train_tokens, steps=steps, **fit)
    posthoc = salaad_init(vanilla, config)
    posthoc = posthoc._replace(low_rank=jax.tree.map(
        lambda x, l: jnp.asarray(x, jnp.float32) if jnp.ndim(l) == 2 else l, vanilla,
        posthoc.low_rank))
    rows.append({"model": "vanilla AdamW (dense)", "fraction": 1.0, "params": n_total,
                 "val_loss": val_loss(eval_fn, vanilla)})
    for frac in BUDGETS:
        alloc = hpa_allocate(posthoc, n_total, int(frac * n_total))
        rows.append({"model": "vanilla + post-hoc SVD", "fraction": frac,
                     "params": alloc.n_params,
                     "val_loss": val_loss(eval_fn, apply_surrogate(vanilla, posthoc, alloc))})

    # Separately trained models, one per budget, sharing the SALAAD run's steps.
    each = max(steps // len(BUDGETS), 1)
    for frac in BUDGETS:
        target = int(frac * n_total)
        if frac == 1.0:
            cfg, n = model_config(), n_total
        else:
            cfg, n = factorized_for_budget(target)
        gdef, p0 = nnx.split(Llama(cfg, rngs=nnx.Rngs(args.seed)), nnx.Param)
        short = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(each // 20, 1), each,
                                                   end_value=0.1 * args.lr)
        tx = adamw(short)
        trained, _, _ = train_steps(make_step(lm_loss(gdef), tx), p0, tx.init(p0), train_tokens,
                                    steps=each, **fit)
        rows.append({"model": f"separate ({each} steps each)", "fraction": frac, "params": n,
                     "rank_ratio": None if frac == 1.0 else cfg.rank_ratio,
                     "val_loss": val_loss(make_eval_fn(gdef), trained)})
        print(f"separate at {frac:.0%}: {n:,} params, val {rows[-1]['val_loss']:.4f}", flush=True)

    print(f"\ndense model {n_total:,} params; SALAAD run {steps} steps "
          f"({salaad_seconds:.0f} s), targets rank {args.rate_rank} / density "
          f"{args.rate_sparsity}, rho {args.rho}")
    rank_rates = [s["rank_rate"] for s in stats.values()]
    densities = [s["density"] for s in stats.values()]
    print(f"per-layer rank rate {min(rank_rates):.3f}..{max(rank_rates):.3f}, density "
          f"{min(densities):.3f}..{max(densities):.3f} over {len(stats)} matrices")
    print("\n".join(markdown_table(["model", "budget", "params", "val loss (nats/byte)"], [
        {"model": r["model"], "budget": f"{r['fraction']:.0%}", "params": f"{r['params']:,}",
         "val loss (nats/byte)": f"{r['val_loss']:.4f}"} for r in rows])))
    summary = {"args": vars(args), "steps": steps, "n_params": n_total, "rows": rows,
               "per_layer": stats}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    plot(rows, Path(args.plot))
    print(f"wrote {out / 'results.json'} and {args.plot}")


def plot(rows, path: Path) -> None:
    curves = []
    for label, style, select in (
            ("SALAAD surrogate (one run)", "o-", lambda m: m == "SALAAD surrogate"),
            ("vanilla + post-hoc SVD", "s--", lambda m: m == "vanilla + post-hoc SVD"),
            ("trained separately (same total compute)", "^:", lambda m: m.startswith("separate"))):
        x, y = zip(*sorted((r["params"], r["val_loss"]) for r in rows if select(r["model"])))
        curves.append({"x": x, "y": y, "style": style, "label": label})
    plot_panels([{"curves": curves, "xlabel": "parameters", "legend_fontsize": 10, "grid": True,
                  "ylabel": "validation loss (nats / byte)"}], str(path), figsize=(6, 4))


if __name__ == "__main__":
    main()
