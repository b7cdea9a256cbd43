"""BaLoRA vs LoRA on the paper's synthetic low-rank regression (Castin et al, Fig. 3).

The problem, the protocol and the study live in :mod:`lowrank_jax.optim.balora_synthetic`;
this script runs the full grid, prints the table and plots it.

Usage::

    python -m scripts.reproduce.balora_synthetic                 # 8 seeds × 50 lrs, seconds
    python -m scripts.reproduce.balora_synthetic --resample-problem \
        --out runs/balora_synth_resampled

Writes ``<out>/results.json`` and ``<out>/synthetic.png`` (median excess loss, log scale, and
median balancing gap ``‖LᵀL − R Rᵀ‖_F`` per step).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.optim.balora_synthetic import run_study


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/reproduce_balora_synthetic")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--n-lrs", type=int, default=50, help="lrs in linspace(1e-5, 0.3, N)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--resample-problem", action="store_true",
                   help="draw a new (W0, T) per seed (default: one problem, seeds vary the init)")
    p.add_argument("--select", default="per_seed", choices=("per_seed", "shared"))
    p.add_argument("--no-procrustes", action="store_true",
                   help="skip the extra BaLoRA run with mode='procrustes'")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    methods = [("LoRA", None), ("BaLoRA", "svd")]
    if not args.no_procrustes:
        methods.append(("BaLoRA-procrustes", "procrustes"))
    start = time.perf_counter()
    res = run_study(seeds=args.seeds, lrs=np.linspace(1e-5, 0.3, args.n_lrs), steps=args.steps,
                    rank=args.rank, resample_problem=args.resample_problem,
                    methods=tuple(methods), how=args.select)
    total = time.perf_counter() - start
    steps = args.steps
    checkpoints = [10, 25, 50, steps]
    header = ("| method | best lr (median; range) | median excess loss at step "
              + " / ".join(str(c) for c in checkpoints)
              + f" | seeds with excess < LoRA's (step {steps}) | median ‖LᵀL−RRᵀ‖_F at step 0 / "
              f"{steps // 2} / {steps} | diverged lrs (seed 0) |")
    lines = [header, "|---|---|---|---|---|---|"]
    lora_final = res["methods"]["LoRA"]["excess"][:, -1]
    summary = {}
    for name, r in res["methods"].items():
        med = np.median(r["excess"], axis=0)
        gap = np.median(r["gap"], axis=0)
        wins = int(np.sum(r["excess"][:, -1] < lora_final))
        lines.append(
            f"| {name} | {np.median(r['lr']):.4g}; {r['lr'].min():.4g}–{r['lr'].max():.4g} | "
            + " / ".join(f"{med[c]:.3g}" for c in checkpoints)
            + f" | {wins if name != 'LoRA' else '—'}/{args.seeds} | "
            f"{gap[0]:.3g} / {gap[steps // 2]:.3g} / {gap[-1]:.3g} | {r['diverged_lrs']} |")
        summary[name] = {"median_excess": med.tolist(), "median_gap": gap.tolist(),
                         "lr": r["lr"].tolist(), "final_excess": r["excess"][:, -1].tolist(),
                         "seconds": r["seconds"]}
    table = "\n".join(lines)
    print(f"L* (median over seeds) = {np.median(res['l_star']):.4f}; "
          f"{args.seeds} seeds × {args.n_lrs} lrs × {steps} steps; total {total:.1f} s "
          "(includes compilation)")
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "l_star": res["l_star"].tolist(), "methods": summary,
                   "table": table, "seconds": total}, f, indent=2)
    styles = {"LoRA": ("C1", "-"), "BaLoRA": ("C0", "-"), "BaLoRA-procrustes": ("C2", "--")}
    excess, gaps = [], []
    for name, r in res["methods"].items():
        color, ls = styles.get(name, ("C3", ":"))
        q = np.quantile(r["excess"], [0.25, 0.5, 0.75], axis=0)
        g = np.quantile(r["gap"], [0.25, 0.5, 0.75], axis=0)
        excess.append({"y": q[1], "band": (q[0], q[2]), "color": color, "style": ls,
                       "label": f"{name} (median lr {np.median(r['lr']):.3g})"})
        gaps.append({"y": np.maximum(g[1], 1e-8), "color": color, "style": ls, "label": name})
    plot_panels([{"curves": excess, "yscale": "log", "xlabel": "step",
                  "ylabel": "loss − L*  (median, IQR band)",
                  "title": f"n=m=20, r={args.rank}, {args.seeds} seeds"},
                 {"curves": gaps, "yscale": "log", "xlabel": "step",
                  "ylabel": "‖LᵀL − RRᵀ‖_F (median, floor 1e-8)"}],
                os.path.join(args.out, "synthetic.png"), figsize=(9, 3.4))
    print(f"wrote {args.out}/results.json and synthetic.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
