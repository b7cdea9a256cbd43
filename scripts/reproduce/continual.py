"""Continual learning with LoRA: does Janus-LoRA forget less than plain LoRA?

A synthetic class-incremental stream (the CPU demo of specs/janus_lora.md): 5 tasks x 4 classes,
inputs in R^64 drawn from Gaussian clusters whose means lie in task-specific, partly overlapping
8-dimensional subspaces. Model: a frozen random 2-layer MLP (64 → 128 → 128, GELU) with rank-4
LoRA on both layers and a cosine classifier (a class's row is trained only during its task).
Every method sees the same data, steps and Adam settings, in the same run:

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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.core.step import make_step
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    decoupled_margin_loss,
    oe_accumulate,
    oe_finalize,
    orthogonality_clamp,
    scale_by_input_projection,
    scale_by_janus,
    set_subspaces,
    with_subspaces,
)
from lowrank_jax.train.continual import continual_metrics

D_IN, HIDDEN, RANK, TASKS, CLASSES_PER_TASK, SUB = 64, 128, 4, 5, 4, 8
SCALE, TEMP, MARGIN, DML_WEIGHT = 1.0, 10.0, 0.2, 0.5
METHODS = ("lora", "joint", "ortho_a", "gr_plain", "janus_gr", "dml_only", "janus")


def make_stream(seed: int, n_per_class: int = 60):
    rng = np.random.default_rng(seed)
    shared = np.linalg.qr(rng.normal(size=(D_IN, 4)))[0]
    data = []
    for t in range(TASKS):
        own = np.linalg.qr(rng.normal(size=(D_IN, SUB - 2)))[0]
        basis = np.linalg.qr(np.concatenate([own, shared[:, :2]], 1))[0]  # partly overlapping
        xs, ys = [], []
        for c in range(CLASSES_PER_TASK):
            mean = basis @ rng.normal(scale=3.0, size=SUB)
            x = mean[:, None] + basis @ rng.normal(scale=1.0, size=(SUB, 2 * n_per_class))
            xs.append(x.T)
            ys.append(np.full(2 * n_per_class, t * CLASSES_PER_TASK + c))
        x, y = np.concatenate(xs).astype(np.float32), np.concatenate(ys)
        perm = rng.permutation(len(y))
        x, y = x[perm], y[perm]
        half = len(y) // 2
        data.append(((x[:half], y[:half]), (x[half:], y[half:])))
    return data


def init_params(seed: int):
    k = jax.random.split(jax.random.key(seed + 1000), 6)
    n_classes = TASKS * CLASSES_PER_TASK
    return {
        "l1": {"kernel": jax.random.normal(k[0], (D_IN, HIDDEN)) / np.sqrt(D_IN),
               "lora_a": jax.random.normal(k[1], (D_IN, RANK)) / np.sqrt(D_IN),
               "lora_b": jnp.zeros((RANK, HIDDEN))},
        "l2": {"kernel": jax.random.normal(k[2], (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN),
               "lora_a": jax.random.normal(k[3], (HIDDEN, RANK)) / np.sqrt(HIDDEN),
               "lora_b": jnp.zeros((RANK, HIDDEN))},
        "head": jax.random.normal(k[4], (n_classes, HIDDEN)) * 0.1,
    }


def layer(p, x):
    return x @ p["kernel"] + SCALE * (x @ p["lora_a"]) @ p["lora_b"]


def features(params, x):
    h1 = jax.nn.gelu(layer(params["l1"], x))
    return h1, jax.nn.gelu(layer(params["l2"], h1))


def logits_fn(params, x, seen_mask):
    _, f = features(params, x)
    f = f / (jnp.linalg.norm(f, axis=-1, keepdims=True) + 1e-6)
    w = params["head"] / (jnp.linalg.norm(params["head"], axis=-1, keepdims=True) + 1e-6)
    return jnp.where(seen_mask, TEMP * f @ w.T, -1e9)


def run_method(method: str, data, seed: int, steps: int, lr: float, batch: int):
    params = init_params(seed)
    n_classes = TASKS * CLASSES_PER_TASK
    memories = {"l1": SubspaceMemory.empty(D_IN), "l2": SubspaceMemory.empty(HIDDEN)}
    thresholds = {"l1": 1 - 1e-6, "l2": 0.97}
    protect = method in ("ortho_a", "gr_plain", "janus_gr", "janus")
    use_dml = method in ("dml_only", "janus")
    if method == "ortho_a":
        tx = with_subspaces(optax.chain(scale_by_input_projection(), optax.adam(lr)))
    elif protect:
        tx = with_subspaces(optax.chain(
            scale_by_janus(SCALE, precondition=method != "gr_plain"), optax.adam(lr),
            orthogonality_clamp()))
    else:
        tx = optax.adam(lr)
    acc = np.zeros((TASKS, TASKS))
    prototypes = np.zeros((0, HIDDEN), np.float32)
    past_inputs = []
    violation = []

    def loss_fn(p, x, y, current, protos):
        # frozen kernels; a class's head row trains only during its task (zero gradient else)
        p = {**{k: {**p[k], "kernel": jax.lax.stop_gradient(p[k]["kernel"])} for k in memories},
             "head": jnp.where(current[:, None], p["head"], jax.lax.stop_gradient(p["head"]))}
        ce = cross_entropy(logits_fn(p, x, current), y)
        if use_dml:
            _, f = features(p, x)
            ce = ce + DML_WEIGHT * decoupled_margin_loss(f, y, protos, p["head"], margin=MARGIN)
        return ce

    step = make_step(loss_fn, tx)

    @jax.jit
    def accuracy(p, x, y, seen):
        return jnp.mean(jnp.argmax(logits_fn(p, x, seen), -1) == y)

    task_list = [list(range(TASKS))] if method == "joint" else [[t] for t in range(TASKS)]
    rng = np.random.default_rng(seed)
    for stage, tasks in enumerate(task_list):
        x_tr = np.concatenate([data[t][0][0] for t in tasks])
        y_tr = np.concatenate([data[t][0][1] for t in tasks])
        last = tasks[-1]
        seen = np.arange(n_classes) < (last + 1) * CLASSES_PER_TASK
        current = np.zeros(n_classes, bool)
        for t in tasks:
            current[t * CLASSES_PER_TASK:(t + 1) * CLASSES_PER_TASK] = True
        if method == "joint":
            current = seen
        bases = {k: m.basis for k, m in memories.items()}
        if protect and stage > 0:  # re-anchor: move a's protected part into the frozen kernel
            for name in ("l1", "l2"):
                v, q = bases[name], params[name]
                protected = v @ (v.T @ q["lora_a"])
                params[name] = {**q, "kernel": q["kernel"] + SCALE * protected @ q["lora_b"],
                                "lora_a": q["lora_a"] - protected}
        opt = tx.init(params)
        if protect:
            opt = set_subspaces(opt, bases)
        before = jax.tree.map(jnp.array, params)
        protos = jnp.asarray(prototypes) if len(prototypes) else jnp.zeros((1, HIDDEN))
        n_steps = steps * len(tasks)
        for i in range(n_steps):
            idx = rng.integers(0, len(y_tr), batch)
            params, opt, _ = step(params, opt, x_tr[idx], y_tr[idx], current, protos)
        # first-layer violation on past inputs
        if past_inputs:
            xp = np.concatenate(past_inputs)
            dw = (params["l1"]["kernel"] + SCALE * params["l1"]["lora_a"] @ params["l1"]["lora_b"]
                  - before["l1"]["kernel"]
                  - SCALE * before["l1"]["lora_a"] @ before["l1"]["lora_b"])
            violation.append(float(jnp.linalg.norm(xp @ dw) / jnp.linalg.norm(xp)))
        # task end: OE on the layer inputs, prototypes, evaluation
        for t in tasks:
            x_t = data[t][0][0]
            h1, f = features(params, x_t)
            memories["l1"] = oe_accumulate(memories["l1"], x_t)
            memories["l2"] = oe_accumulate(memories["l2"], h1)
            f = np.asarray(f / (jnp.linalg.norm(f, axis=-1, keepdims=True) + 1e-6))
            for c in range(t * CLASSES_PER_TASK, (t + 1) * CLASSES_PER_TASK):
                prototypes = np.concatenate([prototypes, f[data[t][0][1] == c].mean(0)[None]])
            past_inputs.append(x_t)
        for name in memories:
            memories[name] = oe_finalize(memories[name], thresholds[name])
        for j in range(last + 1):
            acc[last if method != "joint" else TASKS - 1, j] = float(
                accuracy(params, data[j][1][0], data[j][1][1], seen))
    metrics = continual_metrics(acc)
    avg_acc = metrics.acc
    bwt = metrics.bwt if method != "joint" else float("nan")
    return {"acc": avg_acc, "bwt": bwt, "matrix": acc.tolist(),
            "violation_l1": float(np.mean(violation)) if violation else float("nan")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per task")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--methods", default=",".join(METHODS))
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
