"""Continual LoRA on a real LLM: SmolLM2-135M over text domains that ship with the machine.

Tasks (in order, :mod:`lowrank_jax.data.continual_text`): ``licences`` (package licence files),
``manpages`` (roff man(1) sources), ``code`` (stdlib Python source), ``markdown`` (package
READMEs). Each task trains the same rank-``r`` LoRA on ``q_proj`` and ``v_proj`` of all 30 layers
for the same number of steps; after each task every task's held-out windows are scored
(next-token accuracy and NLL), giving ``R[i, j]``, and ACC / BWT / FWT
(:func:`lowrank_jax.train.continual.continual_metrics`, FWT against the untouched model).

Arms, all with the same rank, steps, batch and (Adam) learning rate:

* ``lora``  — one adapter trained on task after task (the forgetting baseline);
* ``olora`` — O-LoRA style: a fresh adapter per task, the previous ones merged and frozen, and
  ``λ Σ |A_oldᵀ A_new|`` keeping the new ``A`` orthogonal to the old ones (Wang et al. 2023);
* ``janus`` — Janus-LoRA GR + clamp (:func:`lowrank_jax.optim.janus.janus`) with the protected
  input bases from online estimation (``oe_accumulate`` / ``oe_finalize``, energy threshold
  ``--janus-threshold``) and re-anchoring at each task start;
* ``loda``  — LoDA (:mod:`lowrank_jax.optim.loda`): frozen ``A_G`` (shared) / ``A_I`` (isolated)
  of ``rank/2`` each from the energy decomposition, ``B`` trained with GAO (heavy-ball SGD,
  ``--gao-lr``), closed-form recalibration of ``B_G``, merged after each task.

Each arm runs in :func:`lowrank_jax.train.continual_lora.run_continual_lora`.

    python -m scripts.reproduce.llm_continual --seeds 1 --steps 40
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from flax import nnx

from lowrank_jax.data.continual_text import build_continual_text
from lowrank_jax.hub import load_model
from lowrank_jax.runs.results import RunCache, write_result
from lowrank_jax.train.continual_lora import (CONTINUAL_METHODS, ContinualLoRAConfig,
                                              run_continual_lora)
from lowrank_jax.train.losses import window_evaluator


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40, help="steps per task (every arm)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam lr (lora, olora, janus)")
    parser.add_argument("--gao-lr", type=float, default=0.1,
                        help="LoDA's GAO (clipped heavy-ball SGD) lr")
    parser.add_argument("--olora-lambda", type=float, default=0.5)
    parser.add_argument("--janus-threshold", type=float, default=0.97)
    parser.add_argument("--loda-old-energy", type=float, default=0.97)
    parser.add_argument("--loda-lambda", type=float, default=1.0)
    parser.add_argument("--stat-windows", type=int, default=32)
    parser.add_argument("--heldout-windows", type=int, default=32)
    parser.add_argument("--domains", default="licences,manpages,code,markdown")
    parser.add_argument("--methods", default=",".join(CONTINUAL_METHODS))
    parser.add_argument("--cache", default="runs/llm_continual_runs.json",
                        help="finished (method, seed) runs are kept here and reused by a rerun "
                             "with the same settings, so a long command can be resumed")
    args = parser.parse_args()
    t0 = time.perf_counter()
    model, tok = load_model("smollm2")
    tasks = build_continual_text(lambda text: tok.encode(text, add_bos=False),
                                 args.domains.split(","), length=args.length, max_chars=None,
                                 max_train_windows=400, max_heldout_windows=args.heldout_windows)
    for task in tasks:
        print(f"task {task.name}: train {task.train.shape} from {len(task.train_sources)} docs, "
              f"held-out {task.heldout.shape} from {len(task.heldout_sources)} docs")
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    evaluate = window_evaluator(graphdef)
    base = [evaluate(lora, rest, task.heldout) for task in tasks]
    baseline = {"nll": [b[0] for b in base], "acc": [b[1] for b in base]}
    print("base model:", baseline)
    del model
    methods = args.methods.split(",")
    runs = {m: [] for m in methods}
    config = ContinualLoRAConfig(**{f.name: getattr(args, f.name)
                                    for f in dataclasses.fields(ContinualLoRAConfig)
                                    if hasattr(args, f.name)})
    cache = RunCache(args.cache, {k: v for k, v in vars(args).items()
                                  if k not in ("seeds", "methods", "cache")})
    for seed in range(args.seeds):
        for method in methods:
            runs[method].append(cache.get(f"{method}/{seed}", lambda: run_continual_lora(
                lambda: load_model("smollm2")[0], method, tasks, seed=seed, config=config,
                baseline=baseline, log=lambda line: print(line, flush=True)), announce=True))
    columns = ["method", "ACC (next-token acc %)", "BWT (pts)", "FWT (pts)", "final NLL",
               "NLL forgetting (nats)", "seeds"]
    rows = []
    for method in methods:
        r = runs[method]
        mean = lambda k: float(np.mean([x[k] for x in r]))  # noqa: E731
        std = lambda k: float(np.std([x[k] for x in r]))  # noqa: E731
        rows.append({"method": method, "ACC (next-token acc %)": f"{mean('acc'):.2f} ± "
                     f"{std('acc'):.2f}", "BWT (pts)": f"{mean('bwt'):+.2f} ± {std('bwt'):.2f}",
                     "FWT (pts)": f"{mean('fwt'):+.2f}", "final NLL": round(mean('final_nll'), 4),
                     "NLL forgetting (nats)": f"{mean('bwt_nll'):+.4f}", "seeds": len(r)})
    best_bwt = max(methods, key=lambda m: np.mean([x["bwt"] for x in runs[m]]))
    best_acc = max(methods, key=lambda m: np.mean([x["acc"] for x in runs[m]]))
    verdict = (f"Highest ACC: {best_acc}; least forgetting (BWT closest to/above 0): {best_bwt}. "
               "See the note for the claim-by-claim reading.")
    write_result(
        "docs/results/llm_continual",
        "Continual LoRA on SmolLM2-135M over 4 on-machine text domains", columns,
        rows, verdict, extra={"args": vars(args), "baseline": baseline, "runs": runs,
                              "tasks": [t.name for t in tasks],
                              "seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
