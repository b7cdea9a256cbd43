"""LoDA on the continual-learning stream of scripts/reproduce/continual.py.

Same synthetic class-incremental stream (5 tasks x 4 classes), frozen random 2-layer MLP, cosine
classifier, seeds and steps as ``reproduce_continual.py`` (imported as a module, its
``run_method`` gives the baselines ``lora`` and ``janus`` in the same run). LoDA (specs/loda.md,
``lowrank_jax.optim.loda``) adapts both layers with frozen down-projections ``A_G`` (shared)
and ``A_I`` (isolated), chosen per task by projection energy on the current merged backbone,
trains only ``B_G, B_I`` with GAO (SGD + momentum), recalibrates ``B_G`` in closed form and
merges into the kernel after each task.

Arms: ``lora``, ``janus`` (lead's script), ``loda_norecal`` (no recalibration), ``loda``.
By default ``k_G = k_I = 2`` so LoDA's total rank equals the baselines' rank 4.

    python -m scripts.reproduce.continual_loda            # 3 seeds
    python -m scripts.reproduce.continual_loda --quick    # 1 seed, fewer steps
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.core.step import make_step
from lowrank_jax.optim.loda import (
    CovStat,
    decompose,
    feature_stats,
    gao,
    merge,
    recalibrate,
    update_memory,
)
from scripts.reproduce import continual as base  # noqa: E402  (the shared LoRA baselines)

LAYERS = ("l1", "l2")
LODA_METHODS = ("loda_norecal", "loda")


def run_loda(data, seed: int, steps: int, lr: float, gao_lr: float, batch: int, *, k_g: int,
             k_i: int, old_energy: float, lam: float, recal: bool, gao_adam: bool = False):
    """One LoDA run over the stream; returns ACC, BWT, the accuracy matrix and diagnostics."""
    params = base.init_params(seed)
    n_classes = base.TASKS * base.CLASSES_PER_TASK
    dims = {"l1": base.D_IN, "l2": base.HIDDEN}
    kernels = {n: params[n]["kernel"] for n in LAYERS}
    head = params["head"]
    memory = {n: CovStat(jnp.zeros((dims[n], dims[n])), jnp.int32(0)) for n in LAYERS}
    tx_b = gao(gao_lr, momentum=0.9, adam=gao_adam)
    tx_head = optax.adam(lr)
    decomp = jax.jit(decompose, static_argnames=("k_g", "k_i", "old_energy"))

    def as_base_params(kern, frozen, trainable, hd):
        """The lead's parameter layout: lora_a = [A_Gᵀ A_Iᵀ], lora_b = [B_G; B_I]."""
        out = {"head": hd}
        for n in LAYERS:
            out[n] = {"kernel": kern[n],
                      "lora_a": jnp.concatenate([frozen[n]["a_g"].T, frozen[n]["a_i"].T], 1),
                      "lora_b": jnp.concatenate([trainable[n]["b_g"], trainable[n]["b_i"]], 0)}
        return out

    # B factors (GAO) and the head (Adam) in one step; a head row trains only during its task
    tx = optax.partition({"b": tx_b, "head": tx_head}, {"b": "b", "head": "head"})

    def loss_fn(p, kern, frozen, x, y, current):
        hd = jnp.where(current[:, None], p["head"], jax.lax.stop_gradient(p["head"]))
        return cross_entropy(base.logits_fn(as_base_params(kern, frozen, p["b"], hd), x, current),
                             y)

    step = make_step(loss_fn, tx)

    @jax.jit
    def accuracy(kern, hd, x, y, seen):
        p = {"head": hd, **{n: {"kernel": kern[n], "lora_a": jnp.zeros((dims[n], 1)),
                                "lora_b": jnp.zeros((1, base.HIDDEN))} for n in LAYERS}}
        return jnp.mean(jnp.argmax(base.logits_fn(p, x, seen), -1) == y)

    def merged_inputs(x):
        p = {n: {"kernel": kernels[n], "lora_a": jnp.zeros((dims[n], 1)),
                 "lora_b": jnp.zeros((1, base.HIDDEN))} for n in LAYERS}
        h1, _ = base.features(p, x)
        return {"l1": x, "l2": h1}

    acc = np.zeros((base.TASKS, base.TASKS))
    diag = []
    rng = np.random.default_rng(seed)
    for t in range(base.TASKS):
        x_tr, y_tr = data[t][0]
        seen = np.arange(n_classes) < (t + 1) * base.CLASSES_PER_TASK
        current = np.zeros(n_classes, bool)
        current[t * base.CLASSES_PER_TASK:(t + 1) * base.CLASSES_PER_TASK] = True
        # statistics on the current merged backbone, then the task-driven decomposition
        inputs = merged_inputs(jnp.asarray(x_tr))
        stats = {n: feature_stats(inputs[n]) for n in LAYERS}
        frozen, info = {}, {}
        for n in LAYERS:
            sub = decomp(stats[n].c, memory[n].c, k_g=k_g, k_i=k_i, old_energy=old_energy)
            frozen[n] = {"a_g": sub.a_g, "a_i": sub.a_i}
            info[n] = {"old_rank": int(sub.old_rank), "E_new_G": float(sub.energy_new_g),
                       "E_new_I": float(sub.energy_new_i), "E_old_I": float(sub.energy_old_i)}
        trainable = {n: {"b_g": jnp.zeros((k_g, base.HIDDEN)),
                         "b_i": jnp.zeros((k_i, base.HIDDEN))} for n in LAYERS}
        p = {"b": trainable, "head": head}
        opt = tx.init(p)
        for _ in range(steps):
            idx = rng.integers(0, len(y_tr), batch)
            p, opt, _ = step(p, opt, kernels, frozen, x_tr[idx], y_tr[idx], current)
        trainable, head = p["b"], p["head"]
        # recalibrate (before merging and before updating the memory), merge, update memory
        for n in LAYERS:
            b_g = trainable[n]["b_g"]
            if recal:
                b_g = recalibrate(b_g, frozen[n]["a_g"], stats[n].c, memory[n].c, lam=lam)
            info[n]["B_G_shrink"] = float(jnp.linalg.norm(b_g)
                                          / (jnp.linalg.norm(trainable[n]["b_g"]) + 1e-12))
            kernels[n] = merge(kernels[n], frozen[n]["a_g"], b_g, frozen[n]["a_i"],
                               trainable[n]["b_i"], base.SCALE)
            memory[n] = update_memory(memory[n], stats[n])
        diag.append(info)
        for j in range(t + 1):
            acc[t, j] = float(accuracy(kernels, head, data[j][1][0], data[j][1][1], seen))
    final = acc[base.TASKS - 1]
    bwt = float(np.mean([final[j] - acc[j, j] for j in range(base.TASKS - 1)]))
    return {"acc": float(final.mean()), "bwt": bwt, "matrix": acc.tolist(), "diagnostics": diag}


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
        if m not in LODA_METHODS and m not in base.METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from "
                             f"{LODA_METHODS + base.METHODS}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list] = {m: [] for m in methods}
    t0 = time.perf_counter()
    with tqdm(total=len(methods) * args.seeds, desc="continual+loda") as bar:
        for seed in range(args.seeds):
            data = base.make_stream(seed)
            for m in methods:
                if m in LODA_METHODS:
                    r = run_loda(data, seed, args.steps, args.lr, args.gao_lr, args.batch,
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
