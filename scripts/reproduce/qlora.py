"""QLoRA on SmolLM2-135M: the same LoRA fine-tuning on fp32, RTN-4, NF4 and UniSVQ-2 bases.

For each base: quantize the 7 projections of every block
(``lowrank_jax.quantize.qlora_base.quantize_base``),
measure held-out perplexity, fine-tune rank-``r`` LoRA adapters on q/k/v/o/gate/up/down with the
same data, seed and AdamW settings (``lowrank_jax.train.finetune.finetune``), measure perplexity
again, and record trainable / frozen / optimizer bytes. Then merge each quantized adapter back
into a re-quantized base (``lowrank_jax.nn.merge.merge_report``) and report the perplexity that
re-quantization adds.

Train text: the first 90 % of the embedded stdlib-docstring corpus; held-out: its last 10 %
(disjoint). UniSVQ-2 runs the library's calibrated pipeline (``quant.quantize_model``: Hessians
from ``--calib-seqs`` windows of ``--calib-len`` training tokens, LDLQ with ``--tune-iters`` passes,
``--block-steps`` Adam steps of block fine-tuning; ``--unisvq-layers N`` quantizes only the first N
blocks); ``--unisvq-rounding`` restores the Hessian-free nearest-codeword rounding of round 2.

Usage::

    python -m scripts.reproduce.qlora            # 120 steps per base
    python -m scripts.reproduce.qlora --quick    # 30 steps, shorter eval

References:
    Dettmers et al, `QLoRA <https://arxiv.org/abs/2305.14314>`_, 2023.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

BASES = ("fp32", "rtn4", "nf4", "unisvq2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default="runs/reproduce_qlora")
    p.add_argument("--quick", action="store_true", help="30 steps, 1024 eval tokens")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--bases", default=",".join(BASES))
    p.add_argument("--calib-seqs", type=int, default=32, help="UniSVQ calibration windows")
    p.add_argument("--calib-len", type=int, default=128, help="tokens per calibration window")
    p.add_argument("--tune-iters", type=int, default=3, help="UniSVQ LDLQ tune passes")
    p.add_argument("--block-steps", type=int, default=20,
                   help="UniSVQ block fine-tuning Adam steps per block")
    p.add_argument("--unisvq-layers", type=int, default=None,
                   help="quantize only the first N blocks with UniSVQ (default all)")
    p.add_argument("--unisvq-rounding", action="store_true",
                   help="UniSVQ without calibration (Hessian-free rounding, round 2's row)")
    p.add_argument("--img", default=os.path.join("docs", "img", "qlora_loss.png"))
    p.add_argument("--render", default=None, metavar="RESULTS.json",
                   help="only print the table and redraw the plot from a (partial) results.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        print(table(saved["rows"]))
        plot(saved["curves"], args.img)
        return 0
    if args.quick:
        args.steps, args.eval_tokens = 30, 1024
    from lowrank_jax.data import corpus_text
    from lowrank_jax.models import perplexity
    from lowrank_jax.hub import load_model
    from lowrank_jax.nn.merge import merge_report
    from lowrank_jax.quantize.qlora_base import quantize_base
    from lowrank_jax.quantize.pipeline import calibration_tokens
    from lowrank_jax.quant.unisvq import UniSVQConfig
    from lowrank_jax.train.finetune import finetune, token_batches

    os.makedirs(args.out, exist_ok=True)
    _, tok = load_model(args.model)
    text = corpus_text()
    cut = int(0.9 * len(text))
    train_ids = np.asarray(tok.encode(text[:cut], add_bos=False), np.int32)
    held = np.asarray(tok.encode(text[cut:], add_bos=False), np.int32)[: args.eval_tokens]
    ppl = lambda m: perplexity(m, held, window=256, progress=False).perplexity  # noqa: E731
    rows, curves = [], {}
    for name in args.bases.split(","):
        model, _ = load_model(args.model)
        start, cpu0 = time.perf_counter(), time.process_time()
        if name == "unisvq2" and not args.unisvq_rounding:
            calib = calibration_tokens(tok, text[:cut], args.calib_seqs, args.calib_len)
            layers = (None if args.unisvq_layers is None
                      else list(range(min(args.unisvq_layers, len(model.layers)))))
            quantize_base(model, name, calib_tokens=calib, layers=layers,
                          cfg=UniSVQConfig(tune_iters=args.tune_iters,
                                           finetune_steps=args.block_steps))
        elif name != "fp32":
            quantize_base(model, name)
        q_seconds, q_cpu = time.perf_counter() - start, time.process_time() - cpu0
        before = ppl(model)
        result = finetune(model, token_batches(train_ids, args.batch_size, args.seq_len, 0),
                          targets=r"(q|k|v|o|gate|up|down)_proj", rank=args.rank,
                          alpha=2.0 * args.rank, steps=args.steps, lr=args.lr, seed=0,
                          progress=False)
        after = ppl(model)
        row = {"base": name, "ppl_before": before, "ppl_after": after,
               "loss_first": result.losses[0],
               "loss_last10": float(np.mean(result.losses[-10:])),
               "train_seconds": result.seconds, "quantize_seconds": q_seconds,
               "quantize_cpu_seconds": q_cpu,
               **{f"{k}_bytes": v for k, v in result.memory.items()}}
        if name == "unisvq2":
            row["unisvq"] = ("rounding" if args.unisvq_rounding else
                             f"calibrated {args.calib_seqs}x{args.calib_len}, "
                             f"{args.tune_iters} tune, {args.block_steps} FT steps, "
                             f"{'all' if args.unisvq_layers is None else args.unisvq_layers} "
                             "blocks")
        if name != "fp32":
            _, report = merge_report(model, ppl, target="quantized")
            row.update(merged_ppl=report["ppl_merged"], merge_ppl_added=report["ppl_added"],
                       merge_layer_error=report["layer_error_mean"])
        rows.append(row)
        curves[name] = result.losses
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows, "curves": curves}, f, indent=1)
    print(table(rows))
    plot(curves, args.img)
    return 0


def table(rows) -> str:
    mib = lambda b: b / 2**20  # noqa: E731
    fp = next((r for r in rows if r["base"] == "fp32"), rows[0])
    lines = ["| base | ppl before | ppl after | loss (last 10) | trainable MiB | frozen MiB | "
             "optimizer MiB | total vs fp32 LoRA | merged-requantized ppl (added) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        merged = (f"{r['merged_ppl']:.2f} ({r['merge_ppl_added']:+.2f})" if "merged_ppl" in r
                  else "— (fp merge is exact)")
        lines.append(
            f"| {r['base']} | {r['ppl_before']:.2f} | {r['ppl_after']:.2f} | "
            f"{r['loss_last10']:.3f} | {mib(r['trainable_bytes']):.2f} | "
            f"{mib(r['frozen_bytes']):.1f} | {mib(r['optimizer_bytes']):.2f} | "
            f"{r['total_bytes'] / fp['total_bytes']:.2f}× | {merged} |")
    return "\n".join(lines)


def plot(curves, path) -> None:
    from lowrank_jax.analysis.report import plot_curves
    from lowrank_jax.train.sweep import moving_average

    lines = []
    for name, losses in curves.items():
        smooth = moving_average(losses, 5)
        lines.append({"x": np.arange(len(smooth)) + 5, "y": smooth, "label": name})
    plot_curves(lines, path, xlabel="step", ylabel="train loss (5-step mean)",
                title="LoRA r=8 on SmolLM2-135M: fp32 vs quantized bases", figsize=(6, 3.5),
                dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
