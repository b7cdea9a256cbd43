"""Continual learning with LoRA: does Janus-LoRA forget less than plain LoRA?

A synthetic class-incremental stream (the CPU demo of specs/janus_lora.md): 5 tasks x 4 classes,
inputs in R^64 drawn from Gaussian clusters whose means lie in task-specific, partly overlapping
8-dimensional subspaces. Model: a frozen random 2-layer MLP (64 → 128 → 128, GELU) with rank-4
LoRA on both layers and a cosine classifier (a class's row is trained only during its task); both
in :mod:`lowrank_jax.train.class_incremental`. Every method sees the same data, steps and Adam
settings, in the same run:

* ``lora``       — plain sequential LoRA (the forgetting baseline)
* ``joint``      — all tasks' data at once (upper bound)
* ``ortho_a``    — orthogonal-subspace baseline in the style of InfLoRA / LoRA-GPM: OE bases, only
                   A's gradient projected (the ΔB·A term still leaks)
* ``gr_plain``   — Janus GR without preconditioning (``precondition=False``) + OE + clamp
* ``janus_gr``   — Janus OE + GR (preconditioned) + re-anchoring + clamp
* ``dml_only``   — plain LoRA + the decoupled margin loss
* ``janus``      — the full method: OE + GR + DML

Reports ACC (mean final accuracy over tasks) and BWT (mean drop from just-learned to final),
mean ± std over seeds, plus the first-layer null-space violation ‖ΔW X_past‖/‖X_past‖.
LoDA (specs/loda.md) is not implemented yet and is not in the table.

    python -m scripts.reproduce.continual            # 3 seeds, ~3 min on 2 cores
    python -m scripts.reproduce.continual --quick    # 1 seed, fewer steps
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
from tqdm.auto import tqdm

from lowrank_jax.train.class_incremental import INCREMENTAL_METHODS, make_stream, run_method


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per task")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--methods", default=",".join(INCREMENTAL_METHODS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="runs/reproduce_continual")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = 1, 100
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    results: dict[str, list] = {m: [] for m in methods}
    t0 = time.perf_counter()
    with tqdm(total=len(methods) * args.seeds, desc="continual") as bar:
        for seed in range(args.seeds):
            data = make_stream(seed)
            for m in methods:
                results[m].append(run_method(m, data, seed, args.steps, args.lr, args.batch))
                bar.update(1)
    rows = []
    print(f"\n{'method':<10} {'ACC %':>14} {'BWT %':>14} {'viol. L1':>10}")
    for m in methods:
        a = np.array([r["acc"] for r in results[m]]) * 100
        b = np.array([r["bwt"] for r in results[m]]) * 100
        v = np.array([r["violation_l1"] for r in results[m]])
        rows.append({"method": m, "acc_mean": a.mean(), "acc_std": a.std(), "bwt_mean": b.mean(),
                     "bwt_std": b.std(), "violation_l1": float(np.nanmean(v))
                     if not np.all(np.isnan(v)) else None})
        bwt = "—" if np.all(np.isnan(b)) else f"{b.mean():6.1f} ± {b.std():4.1f}"
        vtxt = "—" if np.all(np.isnan(v)) else f"{np.nanmean(v):.1e}"
        print(f"{m:<10} {a.mean():7.1f} ± {a.std():4.1f} {bwt:>14} {vtxt:>10}")
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "summary": rows, "runs": results,
         "seconds": time.perf_counter() - t0}, indent=1))
    print(f"\nwritten {out / 'results.json'}")


if __name__ == "__main__":
    main()
