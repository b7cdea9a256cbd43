"""Reproduce UniSVQ's claim on SmolLM2-135M: 2-bit lattice codes stay far closer to fp32 than RTN.

One run measures, on the same model and the same eval text:
fp32, RTN 4/3/2-bit (group-wise asymmetric), k-means VQ (d=4, 256 centroids, RHT + LDLQ) and
UniSVQ 2-bit (RHT + LDLQ, with and without block fine-tuning), with exact bits per weight and
the quantization time relative to RTN-2's time in this run.

Calibration: the stdlib-docstring corpus (``lowrank_jax.data.corpus_text``); evaluation: the
shipped English license text (``lowrank_jax.models.generate.english_eval_text``), disjoint.

Usage::

    python -m scripts.reproduce.unisvq            # all 30 blocks (~15 min on 2 CPU cores)
    python -m scripts.reproduce.unisvq --quick    # the first 4 blocks only, fewer steps

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="runs/reproduce_unisvq")
    p.add_argument("--quick", action="store_true", help="first 4 blocks, fewer steps")
    p.add_argument("--layers", type=int, default=None, help="quantize only the first N blocks")
    p.add_argument("--calib-seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--tune-iters", type=int, default=3)
    p.add_argument("--finetune-steps", type=int, default=40)
    p.add_argument("--no-kmeans", action="store_true")
    p.add_argument("--no-ablation", action="store_true",
                   help="skip UniSVQ without fine-tuning")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    from flax import nnx

    from lowrank_jax.data import corpus_text
    from lowrank_jax.models import perplexity
    from lowrank_jax.models.hub import load_model
    from lowrank_jax.quant.model import model_bits_per_weight, quantize_model
    from lowrank_jax.quant.unisvq import UniSVQConfig

    if args.quick:
        args.layers = args.layers or 4
        args.calib_seqs = min(args.calib_seqs, 16)
        args.eval_tokens = min(args.eval_tokens, 2048)
        args.finetune_steps = min(args.finetune_steps, 20)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s: {model.cfg.n_layers} blocks")
    n_layers = model.cfg.n_layers
    layers = list(range(min(args.layers, n_layers))) if args.layers else list(range(n_layers))

    calib_ids = np.asarray(tok.encode(corpus_text()), np.int32)
    need = args.calib_seqs * args.seq_len
    if len(calib_ids) < need:
        raise ValueError(f"corpus has {len(calib_ids)} tokens, need {need}; lower --calib-seqs.")
    rng = np.random.default_rng(0)
    starts = rng.choice(len(calib_ids) - args.seq_len, size=args.calib_seqs, replace=False)
    calib = np.stack([calib_ids[s:s + args.seq_len] for s in np.sort(starts)])
    try:
        from lowrank_jax.models.generate import english_eval_text

        eval_text, eval_source = english_eval_text(), "english_eval_text (licenses + Zen)"
    except ImportError:  # DERIVED fallback: a slice of the corpus disjoint from calibration
        eval_text, eval_source = corpus_text()[-200_000:], "corpus tail"
    eval_ids = np.asarray(tok.encode(eval_text), np.int32)[: args.eval_tokens + 1]
    eval_seq = 256
    print(f"calibration {calib.shape} tokens of the stdlib corpus; eval {len(eval_ids) - 1} "
          f"tokens of {eval_source}; blocks quantized: {len(layers)}/{n_layers}")

    graph, fp_state = nnx.split(model)

    def fresh():
        return nnx.merge(graph, jax.tree.map(lambda a: a, fp_state))

    windows = (len(eval_ids) - 1) // eval_seq  # disjoint windows, each scores eval_seq tokens

    def ppl(m):
        return perplexity(m, eval_ids[: windows * eval_seq + 1], window=eval_seq + 1,
                          stride=eval_seq, progress=False).perplexity

    rows = []
    t = time.perf_counter()
    fp_ppl = ppl(fresh())
    rows.append({"method": "fp32", "bits_per_weight": 32.0, "ppl": fp_ppl, "seconds": 0.0})
    print(f"fp32 ppl {fp_ppl:.3f} ({time.perf_counter() - t:.1f}s)")

    base_cfg = UniSVQConfig(tune_iters=args.tune_iters, finetune_steps=args.finetune_steps)
    runs = [("RTN-4", "rtn", 4, base_cfg), ("RTN-3", "rtn", 3, base_cfg),
            ("RTN-2", "rtn", 2, base_cfg)]
    if not args.no_kmeans:
        runs.append(("k-means VQ-2 (RHT+LDLQ)", "kmeans", 2, base_cfg))
    if not args.no_ablation and args.finetune_steps > 0:
        runs.append(("UniSVQ-2 no fine-tune", "unisvq", 2,
                     dataclasses.replace(base_cfg, finetune_steps=0)))
    label = ("UniSVQ-2 no fine-tune" if args.finetune_steps == 0
             else f"UniSVQ-2 + {args.finetune_steps}-step block fine-tune")
    runs.append((label, "unisvq", 2, base_cfg))
    for name, method, bits, cfg in runs:
        m = fresh()
        report = quantize_model(m, calib, method=method, bits=bits, group_size=args.group_size,
                                cfg=cfg, layers=layers)
        value = ppl(m)
        rows.append({
            "method": name, "bits_per_weight": report["bits_per_weight"],
            "model_bits_per_weight": model_bits_per_weight(m) if method != "kmeans" else None,
            "ppl": value, "seconds": report["seconds"],
            "blocks": report["blocks"],
        })
        print(f"{name}: ppl {value:.3f}, {report['bits_per_weight']:.4f} bpw, "
              f"{report['seconds']:.1f}s")

    rtn2 = next(r["seconds"] for r in rows if r["method"] == "RTN-2")
    header = ("| method | bits/weight (quantized projections) | PPL | PPL / fp32 | quant time s "
              "| time / RTN-2 |\n|---|---|---|---|---|---|")
    lines = [header]
    for r in rows:
        rel = "" if r["method"] == "fp32" else f"{r['seconds'] / max(rtn2, 1e-9):.0f}×"
        lines.append(f"| {r['method']} | {r['bits_per_weight']:.4f} | {r['ppl']:.2f} | "
                     f"{r['ppl'] / fp_ppl:.2f} | {r['seconds']:.1f} | {rel} |")
    table = "\n".join(lines)
    print(table)
    result = {
        "args": vars(args), "eval_source": eval_source, "eval_tokens": int(len(eval_ids) - 1),
        "calibration_shape": list(calib.shape), "layers": layers, "rows": rows, "table": table,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [r["method"] for r in rows]
        ax.bar(range(len(rows)), [r["ppl"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log)")
        ax.set_title(f"{args.model}: {len(layers)}/{n_layers} blocks quantized")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "perplexity.png"), dpi=120)
    except Exception as err:  # plotting is optional
        print(f"(no plot: {err})")
    print(f"wrote {args.out}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
