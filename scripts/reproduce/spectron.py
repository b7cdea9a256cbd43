"""Reproduce Spectron's claim at CPU scale: naive AdamW on factors is unstable, Spectron is not.

Trains the same natively factorized Llama (every attention/MLP matrix is ``a @ b``, rank ratio
0.25; embedding/LM head dense) on the embedded byte corpus with

* naive AdamW on all parameters, over a learning-rate sweep (the largest one chosen to be
  unstable),
* Spectron over an η sweep (AdamW at a fixed LR for the non-factor leaves),
* the dense model with AdamW at matched compute: the dense run gets
  ``steps · F_factorized / F_dense`` steps, where ``F = 6·N_matmul + attention`` FLOPs per token
  (``N_matmul`` = parameters in matmuls incl. the tied LM head), so both see the same FLOPs.

All runs advance in lockstep (one step of each run in turn), so machine-load swings hit every
run alike and the step-time overhead of Spectron vs AdamW is a ratio of medians measured in the
same process. Per step it logs the train loss and ``max_layers ‖ΔW‖₂`` computed exactly from the
weights (factors) before and after the step (outside the timed region).

Usage::

    python -m scripts.reproduce.spectron            # default (≤ 15 min on 2 CPU cores)
    python -m scripts.reproduce.spectron --quick    # ~2 min smoke run

Writes ``<out>/results.json`` and ``<out>/loss_curves.png`` (default ``runs/reproduce_spectron``).

References:
    Janson, Oyallon, Belilovsky, `Stabilizing Native Low-Rank LLM Pretraining
    <https://arxiv.org/abs/2602.12429>`_, ICML 2026.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.data import batch_at, corpus_bytes, train_val_split
from lowrank_jax.train.loop import evaluate as lm_evaluate
from lowrank_jax.train.sweep import loss_spike, moving_average
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.optim import max_update_norm, spectron_with_adamw
from lowrank_jax.train import lm_loss, make_eval_fn, make_step
from lowrank_jax.train.lockstep import LockstepRun, train_lockstep
from lowrank_jax.models.flops import training_flops_per_token as flops_per_token


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/reproduce_spectron")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (~2 minutes)")
    p.add_argument("--steps", type=int, default=None, help="factorized-model steps")
    # Defaults sized for a shared 2-core CPU (≤ 15 min); the spec's demo model is
    # --d-model 128 --layers 4 --d-ff 512 --seq 128 --batch 16 (a GPU or an idle machine).
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--rank-ratio", type=float, default=0.25)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    p.add_argument("--etas", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    p.add_argument("--other-lr", type=float, default=3e-3,
                   help="AdamW LR for the non-factor leaves of the Spectron runs")
    p.add_argument("--dense-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.05)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = args.steps or 30
        args.d_model, args.layers, args.d_ff, args.seq, args.batch = 32, 2, 128, 32, 8
        args.eval_batches = 4
    args.steps = args.steps or 200
    return args


# ----------------------------------------------------------------------------- model helpers


def make_config(args, projection: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.heads, n_kv_heads=args.heads, d_ff=args.d_ff,
                       max_seq_len=args.seq, projection=projection, rank_ratio=args.rank_ratio)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = corpus_bytes()
    train, val = train_val_split(tokens)

    fact_cfg, dense_cfg = make_config(args, "factorized"), make_config(args, "dense")
    f_fact, f_dense = flops_per_token(fact_cfg, args.seq), flops_per_token(dense_cfg, args.seq)
    dense_steps = max(1, int(round(args.steps * f_fact / f_dense)))
    tokens_per_step = args.batch * args.seq

    def init_model(cfg):
        model = Llama(cfg, rngs=nnx.Rngs(args.seed))
        graphdef, state = nnx.split(model)
        return graphdef, nnx.as_pure(state)

    fact_graph, fact_params = init_model(fact_cfg)
    adamw_tx = optax.inject_hyperparams(optax.adamw, static_args=("b1", "b2"))(
        learning_rate=1e-3, b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    spectron_tx = optax.inject_hyperparams(
        spectron_with_adamw,
        static_args=("b1", "b2", "ns_steps", "ns_coeffs", "power_iters", "pair_fn"))(
        eta=0.01, adamw_lr=args.other_lr, weight_decay=args.weight_decay)
    adamw_step, fact_eval = make_step(lm_loss(fact_graph), adamw_tx), make_eval_fn(fact_graph)
    spectron_step = make_step(lm_loss(fact_graph), spectron_tx)

    fact_delta = max_update_norm(fact_params)

    def run(name, kind, peak, steps, params, step, tx, rates, delta=fact_delta):
        return LockstepRun(name, step, params, tx.init(params), steps, rates, delta,
                           {"kind": kind, "peak": peak})

    runs = [run(f"adamw lr={lr:g}", "adamw", lr, args.steps, fact_params, adamw_step, adamw_tx,
                {"learning_rate": lr}) for lr in args.adamw_lrs]
    runs += [run(f"spectron eta={eta:g}", "spectron", eta, args.steps, fact_params,
                 spectron_step, spectron_tx, {"eta": eta, "adamw_lr": args.other_lr})
             for eta in args.etas]
    dense_eval = None
    if not args.no_dense:
        dense_graph, dense_params = init_model(dense_cfg)
        dense_eval = make_eval_fn(dense_graph)
        runs.append(run(f"dense adamw lr={args.dense_lr:g}", "dense", args.dense_lr, dense_steps,
                        dense_params, make_step(lm_loss(dense_graph), adamw_tx), adamw_tx,
                        {"learning_rate": args.dense_lr},
                        max_update_norm(dense_params)))

    with tqdm(total=sum(r.steps for r in runs), desc="lockstep training") as bar:
        train_lockstep(runs, lambda step: tuple(jnp.asarray(t) for t in batch_at(
            train, step, args.batch, args.seq, seed=args.seed)), warmup_frac=args.warmup_frac,
            on_step=lambda: bar.update(1))

    results = []
    for run in runs:
        kind, peak = run.tags["kind"], run.tags["peak"]
        evaluate = dense_eval if kind == "dense" else fact_eval
        val_loss = float("nan") if run.diverged else lm_evaluate(
            evaluate, run.params, val, args.batch, args.seq, args.eval_batches)
        losses = np.asarray(run.losses)
        spike = loss_spike(losses, after=max(1, int(round(args.warmup_frac * run.steps))))
        results.append({
            "name": run.name, "kind": kind, "peak_lr_or_eta": peak, "steps": run.steps,
            "tokens": run.steps * tokens_per_step,
            "flops": run.steps * tokens_per_step * (f_dense if kind == "dense" else f_fact),
            "final_train_loss": float(np.mean(losses[-10:])) if len(losses) else float("nan"),
            "final_val_loss": val_loss, "diverged": run.diverged,
            "max_loss_spike_after_warmup": spike,
            "max_delta_w_spectral": float(np.max(run.delta_w)),
            "max_delta_w_over_eta": (float(np.max(run.delta_w)) / peak
                                     if kind == "spectron" else None),
            "median_step_s": statistics.median(run.step_times) if run.step_times else None,
            "losses": run.losses, "delta_w": run.delta_w,
        })

    def median_of(kind):
        times = [t for r in runs if r.tags["kind"] == kind for t in r.step_times]
        return statistics.median(times) if times else float("nan")

    overhead = median_of("spectron") / median_of("adamw")
    summary = {
        "date": time.strftime("%Y-%m-%d"), "device": f"CPU ({os.cpu_count()} cores), "
        f"{platform.processor() or platform.machine()}", "jax": jax.__version__,
        "config": vars(args), "flops_per_token_factorized": f_fact,
        "flops_per_token_dense": f_dense, "dense_steps": dense_steps,
        "spectron_over_adamw_median_step_time": overhead,
        "params_factorized": int(sum(x.size for x in jax.tree.leaves(fact_params))),
        "runs": results,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))

    header = (f"{'run':<22} {'steps':>5} {'val loss':>9} {'spike':>7} {'max‖ΔW‖₂':>10} "
              f"{'/η':>6} {'step ms':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = f"{r['max_delta_w_over_eta']:.2f}" if r["max_delta_w_over_eta"] else "-"
        ms = f"{1e3 * r['median_step_s']:.1f}" if r["median_step_s"] else "-"
        print(f"{r['name']:<22} {r['steps']:>5} {r['final_val_loss']:>9.4f} "
              f"{r['max_loss_spike_after_warmup']:>7.3f} {r['max_delta_w_spectral']:>10.4f} "
              f"{ratio:>6} {ms:>8}")
    print(f"Spectron / AdamW median step time: {overhead:.3f}")
    print(f"dense model: {dense_steps} steps at matched FLOPs "
          f"({f_dense / f_fact:.2f}x FLOPs per token)")
    plot(results, out / "loss_curves.png")
    print(f"wrote {out / 'results.json'} and {out / 'loss_curves.png'}")
    return 0


def plot(results, path: Path) -> None:
    styles = {"adamw": "--", "spectron": "-", "dense": ":"}
    loss_curves, update_curves = [], []
    for r in results:
        smooth = moving_average(r["losses"], max(1, len(r["losses"]) // 50))
        loss_curves.append({"x": np.arange(len(smooth)) * r["flops"] / max(1, r["steps"]),
                            "y": smooth, "style": styles[r["kind"]], "label": r["name"]})
        update_curves.append({"y": r["delta_w"], "style": styles[r["kind"]], "label": r["name"]})
    plot_panels([{"curves": loss_curves, "xlabel": "training FLOPs", "ylim": (0.8, 6.0),
                  "ylabel": "train loss (nats, smoothed)", "title": "Loss at matched compute"},
                 {"curves": update_curves, "xlabel": "step", "yscale": "log", "legend": False,
                  "ylabel": "max over layers ‖ΔW‖₂",
                  "title": "Per-step spectral norm of the weight update"}],
                str(path), figsize=(12, 4.5))


if __name__ == "__main__":
    raise SystemExit(main())
