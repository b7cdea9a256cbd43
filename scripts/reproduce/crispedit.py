"""Reproduce CrispEdit's claim on SmolLM2-135M: edits succeed, capability barely moves.

Arms, all editing the same MLP down-projections from the same base weights, on the same edits:
unconstrained Adam fine-tuning, LoRA fine-tuning (rank 8 on the same layers), and CrispEdit
(K-FAC low-curvature projection, strict order) at γ ∈ {0.8, 0.9, 0.99}. Reports edit success,
paraphrase success, and the relative change of held-text loss / next-token accuracy.

Paper: Ikram et al., CrispEdit, ICML 2026, https://arxiv.org/abs/2602.15823

Usage::

    python -m scripts.reproduce.crispedit            # default (20 edits)
    python -m scripts.reproduce.crispedit --quick    # 10 edits, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from lowrank_jax import editing as ed
from lowrank_jax.analysis.report import plot_panels
from lowrank_jax.curvature import kfac
from lowrank_jax.optim import crispedit as ce

DEFAULT_EDITS = Path(__file__).resolve().parent / "data" / "crispedit_edits.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--edits", default=str(DEFAULT_EDITS))
    p.add_argument("--n-edits", type=int, default=20)
    p.add_argument("--layers", default=r"layers/(1[6-9])/mlp/down_proj")
    p.add_argument("--gammas", default="0.8,0.9,0.99")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam lr for fine-tuning and CrispEdit")
    p.add_argument("--lora-lr", type=float, default=5e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--order", default="strict", choices=["strict", "faithful"])
    p.add_argument("--fisher", default="empirical", choices=["empirical", "sampled"])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--capability-seqs", type=int, default=16)
    p.add_argument("--held-seqs", type=int, default=8)
    p.add_argument("--out", default="runs/reproduce_crispedit")
    p.add_argument("--quick", action="store_true", help="10 edits, 8 steps, 8 capability seqs")
    args = p.parse_args(argv)
    if args.quick:
        args.n_edits, args.steps, args.capability_seqs = min(args.n_edits, 10), 8, 8
    return args


def main(argv=None) -> int:
    from lowrank_jax.hub import load_model
    from lowrank_jax.nn import remove_lora

    args = parse_args(argv)
    gammas = [float(g) for g in args.gammas.split(",")]
    t_start = time.perf_counter()
    edits = ed.load_edits(args.edits)[: args.n_edits]
    model, tok = load_model(args.model)
    paths = ed.matching_layers(model, args.layers)
    cap, held = ed.capability_data(tok, seq_len=args.seq_len, n_capability=args.capability_seqs,
                                   n_held=args.held_seqs)
    kernel_filter = lambda path, x: (path[-1] == "kernel"  # noqa: E731
                                     and kfac.module_path(path[:-1]) in paths)
    original = jax.tree.map(jnp.copy, nnx.state(model, kernel_filter))

    print(f"{len(edits)} edits, layers {paths}, {args.steps} steps; evaluating the base model")
    base = ed.evaluate_edits(model, tok, edits, held)

    t0 = time.perf_counter()
    factors = kfac.estimate_kfac_factors(model, cap, targets=paths, fisher=args.fisher,
                                         rng=jax.random.key(0), progress=tqdm)
    bases = {k: kfac.eigenbasis(f) for k, f in factors.items()}
    projectors = {g: {k: ce.projector_from_eigenbasis(b, g) for k, b in bases.items()}
                  for g in gammas}
    factor_seconds = time.perf_counter() - t0

    arms = [("finetune", None), ("lora", None)] + [("crispedit", g) for g in gammas]
    rows = []
    for method, gamma in tqdm(arms, desc="arms"):
        nnx.update(model, jax.tree.map(jnp.copy, original))
        cfg = ed.EditConfig(
            method=method, layers=args.layers, gamma=gamma or 0.9, steps=args.steps,
            lr=args.lora_lr if method == "lora" else args.lr, order=args.order,
            fisher=args.fisher, lora_rank=args.lora_rank,
        )
        log = ed.edit_model(model, tok, edits, cfg, capability_batches=cap,
                            projector=projectors.get(gamma))
        res = ed.evaluate_edits(model, tok, edits, held)
        if method == "lora":
            remove_lora(model, merge=False)
        name = method if gamma is None else f"crispedit γ={gamma}"
        kept = log.get("kept_fraction")
        rows.append({
            "method": name, **res,
            "loss_change_pct": 100 * (res["loss"] - base["loss"]) / base["loss"],
            "accuracy_change_pct": 100 * (res["next_token_accuracy"]
                                          - base["next_token_accuracy"])
                                   / base["next_token_accuracy"],
            "epochs": log["epochs"], "final_edit_loss": log["losses"][-1],
            "seconds": log["edit_seconds"], "refreshes": log["refreshes"],
            "kept_fraction": None if kept is None else sum(kept.values()) / len(kept),
        })

    header = (f"| {'method':<18} | edit succ | target p | para succ | held loss | Δloss % "
              f"| next-tok acc | Δacc % | kept | epochs |")
    lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    lines.append(f"| {'base model':<18} | {base['edit_success']:9.2f} | {base['target_prob']:8.3f} "
                 f"| {base.get('paraphrase_success', float('nan')):9.2f} | {base['loss']:9.4f} "
                 f"| {0:7.2f} | {base['next_token_accuracy']:12.4f} | {0:6.2f} |   -  |   -    |")
    for r in rows:
        kept = "  -  " if r["kept_fraction"] is None else f"{r['kept_fraction']:.2f}"
        lines.append(
            f"| {r['method']:<18} | {r['edit_success']:9.2f} | {r['target_prob']:8.3f} "
            f"| {r.get('paraphrase_success', float('nan')):9.2f} | {r['loss']:9.4f} "
            f"| {r['loss_change_pct']:+7.2f} | {r['next_token_accuracy']:12.4f} "
            f"| {r['accuracy_change_pct']:+6.2f} | {kept} | {r['epochs']:6d} |")
    table = "\n".join(lines)
    print(table)
    total = time.perf_counter() - t_start
    print(f"K-FAC factors + eigenbases: {factor_seconds:.1f}s; total {total:.1f}s")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "layers": paths, "base": base, "rows": rows,
                   "factor_seconds": factor_seconds, "total_seconds": total,
                   "table": table}, f, indent=2)
    plot_panels([{"curves": [{"x": [r["loss_change_pct"]], "y": [r["edit_success"]], "style": "o",
                              "ms": 8, "annotate": [r["method"]]} for r in rows],
                  "vlines": [(1.0, None, "--")], "legend": False,
                  "xlabel": "held-text loss change (%)", "ylabel": "edit success",
                  "title": f"SmolLM2-135M, {len(edits)} edits"}],
                os.path.join(args.out, "crispedit.png"), figsize=(6, 4))
    print(f"wrote {args.out}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
