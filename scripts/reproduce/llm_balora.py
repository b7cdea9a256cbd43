"""BaLoRA vs LoRA vs PiSSA, and CSPLoRA's rank plan vs uniform rank, on a SmolLM2-135M fine-tune.

One domain of :mod:`lowrank_jax.data.continual_text` (default ``code``: standard-library Python
source), LoRA on ``q_proj`` / ``v_proj`` of all 30 layers, rank 8, AdamW (weight decay 0.01,
constant lr, no warm-up), batch 4 × 64 tokens, the same batches for every run. Every arm sweeps
the same learning rates (``--lrs``) and is reported at its best lr (lowest final held-out loss):

* ``lora``   — PEFT-default init (``A`` he-uniform, ``B = 0``);
* ``balora`` — :func:`lowrank_jax.optim.balora.balora` around the same AdamW (mode ``svd``);
* ``pissa``  — ``init="pissa"`` (top-r singular triplets in the adapter, residual in the kernel);
* ``csplora`` — :func:`lowrank_jax.nn.plan_ranks` (probe + calibrate + allocate) at the parameter
  budget of uniform rank 8, trained like ``lora`` at LoRA's best lr (its uniform twin).

Held-out loss is measured every ``--eval-every`` steps; the target is 80 % of the way from the
untouched model's held-out loss to the best final held-out loss of any run, so it is set by this
run. Writes ``docs/results/llm_balora.json`` and the curves ``docs/img/llm_balora.png``.

    python -m scripts.reproduce.llm_balora --steps 50
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.core.step import make_step
from lowrank_jax.data.continual_text import build_continual_text
from lowrank_jax.hub import load_model
from lowrank_jax.runs.results import RunCache, write_result
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers, plan_ranks
from lowrank_jax.optim.balora import balora
from lowrank_jax.train.losses import adapter_loss, window_evaluator
from lowrank_jax.train.loop import train_windows
from lowrank_jax.analysis.report import plot_curves
from lowrank_jax.train.sweep import best_runs, progress_target, steps_to_target

PATTERN = r"self_attn/(q_proj|v_proj)$"


def make_tx(method: str, lr: float):
    tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    return balora(tx, mode="svd") if method == "balora" else tx


def train_run(method, lr, task, args, ranks=None):
    model, _ = load_model("smollm2")
    init = "pissa" if method == "pissa" else "standard"
    apply_lora(model, LoRARule(PATTERN, rank=args.rank, init=init), rngs=nnx.Rngs(0), ranks=ranks)
    n_params = sum(m.rank * (m.in_features + m.out_features) for _, m in lora_layers(model))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    evaluate = window_evaluator(graphdef)
    tx = make_tx(method, lr)
    step = make_step(adapter_loss(graphdef), tx)
    lora, _, train_losses, curve = train_windows(
        lambda lora, opt, batch: step(lora, opt, rest, batch), lora, tx.init(lora), task.train,
        steps=args.steps, batch_size=args.batch, rng=np.random.default_rng(args.data_seed),
        evaluate=lambda lora: evaluate(lora, rest, task.heldout)[0], eval_every=args.eval_every)
    print(f"  {method:8s} lr {lr:.0e}: held-out {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
          f"({n_params} adapter params)", flush=True)
    return {"method": method, "lr": lr, "curve": curve, "train_losses": train_losses,
            "final": curve[-1][1], "params": n_params}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domain", default="code")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    parser.add_argument("--methods", default="lora,balora,pissa")
    parser.add_argument("--no-csplora", action="store_true")
    parser.add_argument("--probe-batches", type=int, default=4)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--heldout-windows", type=int, default=16)
    parser.add_argument("--cache", default="runs/llm_balora_runs.json",
                        help="finished (arm, lr) runs are kept here and reused by a rerun with the "
                             "same settings")
    args = parser.parse_args()
    t0 = time.perf_counter()
    cache = RunCache(args.cache, {k: v for k, v in vars(args).items()
                                  if k not in ("lrs", "methods", "cache", "no_csplora")})

    def cached(method, lr, **kw):
        return cache.get(f"{method}/{lr:g}", lambda: train_run(method, lr, task, args, **kw))

    model, tok = load_model("smollm2")
    task = build_continual_text(lambda text: tok.encode(text, add_bos=False), [args.domain],
                                length=args.length, max_chars=None, max_train_windows=400,
                                max_heldout_windows=args.heldout_windows)[0]
    lrs = [float(x) for x in args.lrs.split(",")]
    runs = [cached(m, lr) for m in args.methods.split(",") for lr in lrs]
    best = best_runs(runs)
    plan = None
    if not args.no_csplora and "lora" in best:
        batches = [(jnp.asarray(task.train[i:i + args.batch, :-1]),
                    jnp.asarray(task.train[i:i + args.batch, 1:]))
                   for i in range(0, args.batch * args.probe_batches, args.batch)]
        plan, _ = plan_ranks(model, batches, targets=PATTERN, average_rank=args.rank)
        print("CSPLoRA plan (rank: count):", {r: list(plan.values()).count(r)
                                              for r in sorted(set(plan.values()))})
        run = cached("csplora", best["lora"]["lr"], ranks=plan)
        runs.append(run)
        best["csplora"] = run
    del model
    start = runs[0]["curve"][0][1]
    floor = min(r["final"] for r in best.values())
    target = progress_target(start, floor)
    columns = ["arm", "best lr", "steps to target", "final held-out NLL", "adapter params",
               "final NLL per lr"]
    rows = []
    for method, run in best.items():
        per_lr = ", ".join(f"{r['lr']:.0e}: {r['final']:.3f}" for r in runs
                           if r["method"] == method)
        rows.append({"arm": method, "best lr": f"{run['lr']:.0e}",
                     "steps to target": steps_to_target(run["curve"], target) or f">{args.steps}",
                     "final held-out NLL": round(run["final"], 4),
                     "adapter params": run["params"], "final NLL per lr": per_lr})
    st = {m: steps_to_target(r["curve"], target) or 10**9 for m, r in best.items()}
    verdict = []
    if "balora" in st and "lora" in st:
        faster = st["balora"] < st["lora"]
        verdict.append(f"BaLoRA faster than LoRA to the target: {'yes' if faster else 'no'} "
                       f"({_fmt(st['balora'])} vs {_fmt(st['lora'])} steps; final "
                       f"{best['balora']['final']:.3f} vs {best['lora']['final']:.3f}).")
    if "pissa" in st:
        verdict.append(f"PiSSA: {_fmt(st['pissa'])} steps, final {best['pissa']['final']:.3f}.")
    if "csplora" in st:
        gain = best["lora"]["final"] - best["csplora"]["final"]
        verdict.append(f"CSPLoRA plan vs uniform rank {args.rank} at equal budget "
                       f"({best['csplora']['params']} vs {best['lora']['params']} params): "
                       f"final held-out NLL {best['csplora']['final']:.3f} vs "
                       f"{best['lora']['final']:.3f} ({gain:+.3f} nats gain).")
    plot(runs, best, target, pathlib.Path("docs/img/llm_balora.png"))
    write_result(
        "docs/results/llm_balora",
        f"BaLoRA / LoRA / PiSSA / CSPLoRA on a SmolLM2-135M fine-tune ({args.domain})",
        columns, rows, " ".join(verdict) + f" Target held-out NLL {target:.3f} (start "
        f"{start:.3f}); one data seed, adapter seed 0.",
        extra={"args": vars(args), "runs": runs, "plan": plan, "target": target,
               "seconds": time.perf_counter() - t0},
        note="![held-out loss curves](../img/llm_balora.png)")


def _fmt(steps):
    return ">max" if steps >= 10**9 else str(steps)


def plot(runs, best, target, path):
    colors = {"lora": "C0", "balora": "C1", "pissa": "C2", "csplora": "C3"}
    curves = []
    for run in runs:
        is_best = best.get(run["method"]) is run
        x, y = zip(*run["curve"])
        curves.append({"x": x, "y": y, "color": colors.get(run["method"], "k"),
                       "alpha": 1.0 if is_best else 0.25, "lw": 2 if is_best else 1,
                       "label": f"{run['method']} (lr {run['lr']:.0e})" if is_best else None})
    plot_curves(curves, path, xlabel="step", ylabel="held-out NLL (nats)",
                title="SmolLM2-135M, LoRA q/v rank 8 (faint: other lrs)",
                hline=(target, "target"), legend_fontsize=8)


if __name__ == "__main__":
    main()
