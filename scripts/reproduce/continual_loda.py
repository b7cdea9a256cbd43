"""LoDA on the continual-learning stream of scripts/reproduce/continual.py.

Same synthetic class-incremental stream (5 tasks x 4 classes), frozen random 2-layer MLP, cosine
classifier, seeds and steps as ``scripts/reproduce/continual.py``
(:mod:`lowrank_jax.train.class_incremental`: ``run_method`` gives the baselines ``lora`` and
``janus`` in the same run, ``run_loda`` the LoDA arms). LoDA (specs/loda.md,
``lowrank_jax.optim.loda``) adapts both layers with frozen down-projections ``A_G`` (shared)
and ``A_I`` (isolated), chosen per task by projection energy on the current merged backbone,
trains only ``B_G, B_I`` with GAO (SGD + momentum), recalibrates ``B_G`` in closed form and
merges into the kernel after each task.

Arms: ``lora``, ``janus``, ``loda_norecal`` (no recalibration), ``loda``.
By default ``k_G = k_I = 2`` so LoDA's total rank equals the baselines' rank 4.

    python -m scripts.reproduce.continual_loda            # 3 seeds
    python -m scripts.reproduce.continual_loda --quick    # 1 seed, fewer steps
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np
from tqdm.auto import tqdm

from lowrank_jax.train import class_incremental as base

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="steps per task (all methods)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam lr (baselines, LoDA head)")
    parser.add_argument("--gao-lr", type=float, default=0.03, help="GAO (SGD momentum) lr for B")
    parser.add_argument("--gao-adam", action="store_true", help="ablation: Adam instead of GAO")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k-g", type=int, default=base.RANK // 2)
    parser.add_argument("--k-i", type=int, default=base.RANK - base.RANK // 2)
    parser.add_argument("--old-energy", type=float, default=0.97)
    parser.add_argument("--lam", type=float, default=1.0)
    parser.add_argument("--methods", default="lora,janus,loda_norecal,loda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="runs/reproduce_continual_loda")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = 1, 100
    methods = args.methods.split(",")
    for m in methods:
        if m not in base.LODA_METHODS and m not in base.INCREMENTAL_METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from "
                             f"{base.LODA_METHODS + base.INCREMENTAL_METHODS}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list] = {m: [] for m in methods}
    t0 = time.perf_counter()
    with tqdm(total=len(methods) * args.seeds, desc="continual+loda") as bar:
        for seed in range(args.seeds):
            data = base.make_stream(seed)
            for m in methods:
                if m in base.LODA_METHODS:
                    r = base.run_loda(data, seed, args.steps, args.lr, args.gao_lr, args.batch,
                                 k_g=args.k_g, k_i=args.k_i, old_energy=args.old_energy,
                                 lam=args.lam, recal=m == "loda", gao_adam=args.gao_adam)
                else:
                    r = base.run_method(m, data, seed, args.steps, args.lr, args.batch)
                results[m].append(r)
                bar.update(1)
    rows = []
    print(f"\n{'method':<13} {'ACC %':>14} {'BWT %':>14}")
    for m in methods:
        a = np.array([r["acc"] for r in results[m]]) * 100
        b = np.array([r["bwt"] for r in results[m]]) * 100
        rows.append({"method": m, "acc_mean": float(a.mean()), "acc_std": float(a.std()),
                     "bwt_mean": float(b.mean()), "bwt_std": float(b.std())})
        bwt = "—" if np.all(np.isnan(b)) else f"{b.mean():6.1f} ± {b.std():4.1f}"
        print(f"{m:<13} {a.mean():7.1f} ± {a.std():4.1f} {bwt:>14}")
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "summary": rows, "runs": results,
         "seconds": time.perf_counter() - t0}, indent=1))
    print(f"\nwritten {out / 'results.json'}")


if __name__ == "__main__":
    main()
