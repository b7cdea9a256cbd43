"""LoRA vs BaLoRA on a tiny fine-tuning task, over the paper's 2-D grid of learning rate × scale.

Task (CPU-sized): a tiny byte-level Llama (d=64, 2 layers) is pretrained briefly on the first 70%
of the embedded corpus, then LoRA adapters on the MLP projections (gate/up/down, rank 8, as in the
BaLoRA paper) are fine-tuned on a *shifted* slice (bytes 70–90%, other standard-library modules)
and evaluated on the last 10%. SmolLM2-135M is far too slow for a 2-D sweep on a shared 2-core
CPU, so the tiny model is used.

Protocol (the paper's, ``experiments/configs`` of github.com/vcastin/balora):
- AdamW (β = 0.9, 0.999, eps 1e-8, weight decay 0.01), constant learning rate, no warm-up, the
  same for every method; BaLoRA = :func:`lowrank_jax.optim.balora.balora` (the projection after
  every step, mode ``"svd"`` as in the reference; ``balora-procrustes`` is the library default).
- Adapter ``ΔW = s · A B`` with PEFT's default init (A kaiming-uniform ``U(±1/√in)``, B = 0) and
  ``lora_alpha = rank · A_scaling²``, i.e. ``s = A_scaling²``.
- Sweep: learning rate × A_scaling, one seed; then ``--seeds`` seeds at each method's best cell
  (by final smoothed training loss).

Seeds change the adapter initialisation; every run sees the same batches. Reported per method:
best cell, steps until the smoothed (EMA 0.9) training loss first reaches a target (80% of the way
from the initial loss to the best method's final loss, so set by this run itself), final loss,
validation loss, and robustness: how many grid cells end within X% of the method's best final
loss. Every run is one jitted ``lax.scan``; learning rate and scale are traced arguments, so each
method compiles once for the whole grid.

Usage::

    python -m scripts.reproduce.balora --quick        # tiny grid, ~1-2 minutes
    python -m scripts.reproduce.balora                # 13 lrs × 9 scales × 3 methods, 3 seeds

Claims checked (Castin et al, https://arxiv.org/abs/2605.31484): BaLoRA converges faster than
LoRA and is more robust to the (learning rate, scale) choice.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import numpy as np

from lowrank_jax.train.sweep import (
    best_cell,
    count_within,
    ema,
    finite_or_inf,
    mean_std,
    parse_grid,
    progress_target,
    steps_to_target,
)

# method -> BaLoRA projection mode (None: plain AdamW on the factors). PiSSA has no free scale
# (its factors are the kernel's top-r singular triplets at s = 1), so it sweeps the learning rate
# only, at A_scaling = 1, and is left out of the (lr, scale) heatmap and robustness counts.
METHODS = {"lora": None, "balora": "svd", "balora-procrustes": "procrustes", "pissa": None}
FIXED_SCALE = {"pissa": 1.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/reproduce_balora")
    p.add_argument("--quick", action="store_true", help="3 lrs × 2 scales, 40 steps, 2 seeds")
    p.add_argument("--seeds", type=int, default=3, help="seeds at each method's best cell")
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lrs", default="logspace:-5:-1:13",
                   help="learning rates (paper: logspace:-5:-2:10)")
    p.add_argument("--a-scalings", default="logspace:-2:2:9",
                   help="A_scaling values, s = A_scaling² (paper: logspace:-2:2:5)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--methods", default="lora,balora,balora-procrustes,pissa",
                   help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--target-fraction", type=float, default=0.8)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tqdm import tqdm

    from lowrank_jax.analysis.report import plot_panels, plot_grid_heatmaps, write_json
    from lowrank_jax.core.step import make_step, scan_train, trainable
    from lowrank_jax.data import batch_at, corpus_bytes, eval_batches
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.nn import LoRALinear, LoRARule, apply_lora, peft_lora_state
    from lowrank_jax.optim.balora import balora, relative_balancing_gap
    from lowrank_jax.train.loop import lm_loss, train_steps
    from lowrank_jax.train.losses import scaled_adapter_loss

    if args.quick:
        args.pretrain_steps, args.steps, args.seeds = 100, 40, 2
        args.lrs, args.a_scalings = "1e-4,1e-3,1e-2", "1,10"
    lrs, a_scalings = parse_grid(args.lrs), parse_grid(args.a_scalings)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: {unknown} unknown; use {', '.join(METHODS)}.")
    os.makedirs(args.out, exist_ok=True)
    wall_start = time.perf_counter()

    tokens = corpus_bytes().astype(np.int32)
    n = len(tokens)
    cut1, cut2 = int(0.7 * n), int(0.9 * n)
    pre, shift, val = tokens[:cut1], tokens[cut1:cut2], tokens[cut2:]

    # --- pretraining (all parameters) -------------------------------------------------------
    model = preset_model("tiny", seed=0)
    pre_graph, params = nnx.split(model)
    pre_tx = optax.adamw(3e-3, weight_decay=0.01)
    start = time.perf_counter()
    params, _, pre_losses = train_steps(
        make_step(lm_loss(pre_graph), pre_tx, wrt=nnx.Param), params,
        pre_tx.init(trainable(params, nnx.Param)), pre,
        steps=args.pretrain_steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=1,
        desc="pretrain")
    pre_loss = pre_losses[-1]
    nnx.update(model, params)
    pretrain_seconds = time.perf_counter() - start

    # --- adapters: scale 1 inside the module, s applied to lora_a in the loss (traced) --------
    apply_lora(model, LoRARule("mlp/(gate|up|down)_proj", rank=args.rank, alpha=float(args.rank)),
               rngs=nnx.Rngs(0))
    graphdef, lora_template, rest = nnx.split(model, nnx.LoRAParam, ...)
    # PiSSA: factors = top-r singular triplets of each kernel (s = 1), kernel keeps the residual
    pissa_model = nnx.merge(graphdef, lora_template, rest, copy=True)  # `rest` stays intact
    for _, module in nnx.iter_modules(pissa_model):
        if isinstance(module, LoRALinear):
            module.init_pissa()
    _, pissa_lora, pissa_rest = nnx.split(pissa_model, nnx.LoRAParam, ...)

    def peft_init(seed: int):
        return peft_lora_state(lora_template, jax.random.key(seed))

    loss_fn = scaled_adapter_loss(graphdef)  # s multiplies every lora_a (traced)

    def train(lora0, lr, scale, xs, ys, base, *, mode):
        tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
        tx = tx if mode is None else balora(tx, mode=mode)
        return scan_train(loss_fn, tx, lora0, (xs, ys), scale, base)

    train_fns = {m: jax.jit(functools.partial(train, mode=METHODS[m])) for m in methods}
    xs, ys = map(np.stack, zip(*[batch_at(shift, s, args.batch_size, args.seq_len, seed=100)
                                 for s in range(args.steps)]))
    xs, ys = jnp.asarray(xs), jnp.asarray(ys)
    val_x, val_y = map(np.stack, zip(*eval_batches(val, 16, args.seq_len, max_batches=8)))
    val_x, val_y = jnp.asarray(val_x), jnp.asarray(val_y)

    @jax.jit
    def validation(lora, scale, base):
        return jnp.mean(jax.vmap(lambda x, y: loss_fn(lora, x, y, scale, base))(val_x, val_y))

    def run(method, seed, lr, a_scaling):
        scale = jnp.float32(a_scaling**2)
        lora0, base = (pissa_lora, pissa_rest) if method == "pissa" else (peft_init(seed), rest)
        t = time.perf_counter()
        lora, losses = jax.block_until_ready(
            train_fns[method](lora0, jnp.float32(lr), scale, xs, ys, base))
        seconds = time.perf_counter() - t
        losses = [float(v) for v in np.asarray(losses)]
        finite = all(math.isfinite(v) for v in losses)
        return {"method": method, "seed": seed, "lr": lr, "a_scaling": a_scaling,
                "s": a_scaling**2, "losses": losses, "final": ema(losses)[-1],
                "val_loss": float(validation(lora, scale, base)) if finite else float("nan"),
                "relative_balancing_gap": relative_balancing_gap(lora) if finite
                else float("nan"), "seconds": seconds}

    base_val = float(validation(peft_init(0), jnp.float32(1.0), rest))  # B = 0: base model
    print(f"pretrained {args.pretrain_steps} steps in {pretrain_seconds:.0f} s: "
          f"train loss {pre_loss:.3f}, shifted-slice val loss {base_val:.3f} nats/byte")

    # --- 2-D sweep, seed 0 --------------------------------------------------------------------
    scales_of = {m: [FIXED_SCALE[m]] if m in FIXED_SCALE else a_scalings for m in methods}
    cells = {m: [(lr, a) for a in scales_of[m] for lr in lrs] for m in methods}
    sweep = [run(m, 0, lr, a) for m, lr, a in tqdm(
        [(m, lr, a) for m in methods for lr, a in cells[m]], desc="sweep (lr × scale)")]
    all_grids = {m: np.array([[finite_or_inf(r["final"]) for r in sweep
                               if r["method"] == m and r["a_scaling"] == a]
                              for a in scales_of[m]]) for m in methods}  # [scales, lrs]
    best = {m: best_cell(g) for m, g in all_grids.items()}
    best_cell_of = {m: (lrs[j], scales_of[m][i]) for m, (i, j) in best.items()}

    # --- seeds at each method's best cell -----------------------------------------------------
    chosen = [run(m, seed, *best_cell_of[m]) for m, seed in tqdm(
        [(m, seed) for m in methods for seed in range(args.seeds)], desc="seeds at best cells")]
    initial = float(np.mean([r["losses"][0] for r in chosen]))
    best_final = min(np.mean([r["final"] for r in chosen if r["method"] == m]) for m in methods)
    target = progress_target(initial, best_final, args.target_fraction)

    overall_best = min(float(np.min(g)) for g in all_grids.values())
    tolerances = (0.005, 0.01, 0.02)
    rows = []
    for m in methods:
        rs = [r for r in chosen if r["method"] == m]
        reached = [steps_to_target(list(enumerate(ema(r["losses"]), start=1)), target)
                   for r in rs]
        g = all_grids[m]
        row = {"method": m, "lr": best_cell_of[m][0], "a_scaling": best_cell_of[m][1],
               "s": best_cell_of[m][1] ** 2, "seeds": len(rs),
               "reached": sum(x is not None for x in reached), "steps_to_target": reached}
        for key, values in (("steps_to_target", reached),
                            ("final_train_loss", [r["final"] for r in rs]),
                            ("val_loss", [r["val_loss"] for r in rs])):
            row[f"{key}_mean"], row[f"{key}_std"] = mean_std(values)
        rows.append({
            **row,
            "relative_balancing_gap": float(np.mean([r["relative_balancing_gap"] for r in rs])),
            "seconds_per_run": float(np.mean([r["seconds"] for r in rs])),
            "cells": int(g.size), "diverged_cells": int(np.sum(~np.isfinite(g))),
            "within_own_best": {f"{t:g}": count_within(g, np.min(g), t) for t in tolerances},
            "within_overall_best": {f"{t:g}": count_within(g, overall_best, t)
                                    for t in tolerances},
        })

    def pct(t):
        return f"{100 * t:g}%"

    header = (f"| method | best cell: lr, A_scaling (s) | steps to loss {target:.3f} (reached) | "
              "final train loss | val loss | ‖AᵀA−BBᵀ‖/‖AB‖ | s/run |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['lr']:.3g}, {row['a_scaling']:.3g} ({row['s']:.3g}) | "
            f"{row['steps_to_target_mean']:.1f} ± {row['steps_to_target_std']:.1f} "
            f"({row['reached']}/{row['seeds']}) | "
            f"{row['final_train_loss_mean']:.4f} ± {row['final_train_loss_std']:.4f} | "
            f"{row['val_loss_mean']:.4f} ± {row['val_loss_std']:.4f} | "
            f"{row['relative_balancing_gap']:.2e} | {row['seconds_per_run']:.1f} |")
    table = "\n".join(lines)
    robust_lines = [
        "| method | cells | diverged (NaN) | "
        + " | ".join(f"within {pct(t)} of own best" for t in tolerances) + " | "
        + " | ".join(f"within {pct(t)} of overall best" for t in tolerances) + " |",
        "|---|---|---|" + "---|" * (2 * len(tolerances)),
    ]
    for row in rows:
        if row["method"] in FIXED_SCALE:  # no scale axis: not comparable cell counts
            continue
        robust_lines.append(
            f"| {row['method']} | {row['cells']} | {row['diverged_cells']} | "
            + " | ".join(str(row["within_own_best"][f"{t:g}"]) for t in tolerances) + " | "
            + " | ".join(str(row["within_overall_best"][f"{t:g}"]) for t in tolerances) + " |")
    robust = "\n".join(robust_lines)
    grid_lines = []
    for m in methods:
        grid_lines.append(f"{m}: final smoothed train loss, rows A_scaling (s), columns lr")
        grid_lines.append("| A_scaling (s) | " + " | ".join(f"{lr:.2g}" for lr in lrs) + " |")
        grid_lines.append("|---|" + "---|" * len(lrs))
        for a, vals in zip(scales_of[m], all_grids[m]):
            grid_lines.append(f"| {a:.3g} ({a * a:.3g}) | "
                              + " | ".join("nan" if not np.isfinite(v) else f"{v:.3f}"
                                           for v in vals) + " |")
        grid_lines.append("")
    grids = "\n".join(grid_lines)
    wall = time.perf_counter() - wall_start
    print(f"\ninitial fine-tune loss {initial:.4f}, target {target:.4f} "
          f"({100 * args.target_fraction:g}% of the way to the best final loss {best_final:.4f}); "
          f"pre-fine-tune val loss {base_val:.4f}; overall best sweep cell {overall_best:.4f}")
    print(table)
    print()
    print(robust)
    print()
    print(grids)
    print(f"wall time {wall:.0f} s (pretraining {pretrain_seconds:.0f} s)")
    write_json({"args": vars(args), "lrs": lrs, "a_scalings": a_scalings, "target": target,
                "initial": initial, "pretrain_val_loss": base_val, "overall_best": overall_best,
                "rows": rows, "grid_final_loss": all_grids, "sweep": sweep, "chosen": chosen,
                "table": table, "robustness": robust, "grids": grids, "wall_seconds": wall},
               os.path.join(args.out, "results.json"))
    curves = []
    for m in methods:
        smooth = np.array([ema(r["losses"]) for r in chosen if r["method"] == m])
        lr, a = best_cell_of[m]
        curves.append({"y": smooth.mean(0), "band": (smooth.min(0), smooth.max(0)),
                       "label": f"{m} (lr {lr:.2g}, s {a * a:.3g})"})
    plot_panels([{"curves": curves, "hlines": [(target, "target", "--")], "legend_fontsize": 10,
                  "xlabel": "fine-tuning step", "ylabel": "smoothed train loss (nats/byte)"}],
                os.path.join(args.out, "loss.png"), figsize=(6, 4))
    plot_grid_heatmaps({m: g for m, g in all_grids.items() if m not in FIXED_SCALE},
                       os.path.join(args.out, "heatmap.png"),
                       xticks=[f"{v:.0e}" for v in lrs],
                       yticks=[f"{a * a:.0e}" for a in a_scalings],
                       xlabel="learning rate", ylabel="scale s = alpha / rank = A_scaling²",
                       colorbar="final smoothed train loss", vmax=initial + 0.05)
    print(f"wrote {args.out}/results.json, loss.png and heatmap.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
