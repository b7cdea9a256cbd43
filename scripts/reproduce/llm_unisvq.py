"""UniSVQ-2 with per-group ``A``/``b`` vs per-matrix UniSVQ-2 vs k-means VQ-2 on SmolLM2-135M.

The spec's open question: is one lattice ``A [4,4]``, ``b [4]`` per matrix enough, or does a
lattice per *group* (``UniSVQConfig.affine_groups``,
:func:`lowrank_jax.quant.unisvq.quantize_linear_grouped`) close the gap to an unconstrained
256×4 k-means codebook at the same bits per weight? Every arm quantizes the same real
projections (all 7 of the chosen decoder blocks) with the same RHT, the same calibration
Hessians ``E[xxᵀ]`` (stdlib docstrings) and the same LDLQ (``tune_iters``); none gets block
fine-tuning, so the comparison isolates the codebook (the arms of
:mod:`lowrank_jax.quant.codebooks`: ``unisvq2``, ``unisvq2+refit``, ``unisvq2-blocks``,
``unisvq2-g48``, ``unisvq2-g48+refit`` — at (just under) k-means' bits per weight — and
``kmeans-vq2``, the 256×4 k-means codebook).

Measured: exact bits per weight; the relative output error ``tr(E H Eᵀ)/tr(W H Wᵀ)`` on the
calibration Hessian and on a held-out Hessian (the shipped licence text); and the held-out NLL of
the model with those blocks' projections replaced by the dense dequantized weights.

    python -m scripts.reproduce.llm_unisvq --blocks 0,10,20,29
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from lowrank_jax.data import corpus_text
from lowrank_jax.hub import load_model
from lowrank_jax.runs.results import write_result
from lowrank_jax.models.generate import english_eval_text
from lowrank_jax.models.llama import PROJECTIONS
from lowrank_jax.quant.codebooks import CODEBOOK_ARMS, codebook_arm
from lowrank_jax.quantize.pipeline import (
    SHARED_INPUT,
    calibration_hessians,
    calibration_tokens,
    dequantized_projections,
)
from lowrank_jax.quant.unisvq import UniSVQConfig, proxy_loss
from lowrank_jax.train.losses import window_evaluator


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="0,10,20,29", help="decoder blocks to quantize")
    parser.add_argument("--calib-seqs", type=int, default=32)
    parser.add_argument("--eval-seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tune-iters", type=int, default=3)
    parser.add_argument("--damp", type=float, default=1e-2)
    parser.add_argument("--arms", default=",".join(CODEBOOK_ARMS))
    args = parser.parse_args()
    t0 = time.perf_counter()
    blocks = [int(b) for b in args.blocks.split(",")]
    arms = args.arms.split(",")
    model, tok = load_model("smollm2")
    calib = calibration_tokens(tok, corpus_text(), args.calib_seqs, args.seq_len, 0)
    heldout = calibration_tokens(tok, english_eval_text(), args.eval_seqs, args.seq_len + 1, 1)
    paths = [f"layers/{b}/{p}" for b in blocks for p in sorted(set(SHARED_INPUT.values()))]
    h_cal = calibration_hessians(model, calib, paths, damp=args.damp)
    h_eval = calibration_hessians(model, heldout[:, :-1], paths, damp=args.damp)
    evaluate = window_evaluator(nnx.graphdef(model), batch_size=8)
    fp_nll = evaluate(nnx.state(model), heldout)[0]
    print(f"fp32 held-out NLL {fp_nll:.4f}; calibration {calib.shape}, held-out {heldout.shape}")
    cfg = UniSVQConfig(tune_iters=args.tune_iters)
    results = {}
    for arm in arms:
        ta = time.perf_counter()

        def quantize(i, name, w, arm=arm):
            key = jax.random.fold_in(jax.random.PRNGKey(0), 7 * i + PROJECTIONS.index(name))
            return codebook_arm(arm, w, h_cal[f"layers/{i}/{SHARED_INPUT[name]}"], cfg, key)

        with dequantized_projections(model, blocks, quantize) as done:
            nll = evaluate(nnx.state(model), heldout)[0]
        err_cal, err_eval = ([float(proxy_loss(w, w_hat, h[f"layers/{i}/{SHARED_INPUT[name]}"]))
                              for (i, name), (w, w_hat, _) in done.items()]
                             for h in (h_cal, h_eval))
        bits = sum(bpw * w.size for w, _, bpw in done.values())
        weights = sum(w.size for w, _, _ in done.values())
        results[arm] = {"bits_per_weight": bits / weights, "err_cal": float(np.mean(err_cal)),
                        "err_heldout": float(np.mean(err_eval)), "nll": nll,
                        "nll_increase": nll - fp_nll, "per_matrix_heldout": err_eval,
                        "seconds": time.perf_counter() - ta}
        print(f"  {arm:18s} {bits / weights:.4f} bpw  err cal {np.mean(err_cal):.4f} held-out "
              f"{np.mean(err_eval):.4f}  NLL {nll:.4f} (+{nll - fp_nll:.4f})  "
              f"{time.perf_counter() - ta:.0f}s", flush=True)
    ref = results.get("kmeans-vq2")
    columns = ["arm", "bits/weight", "rel. output error (calib)", "rel. output error (held-out)",
               "held-out NLL", "NLL increase over fp32", "gap vs k-means VQ-2"]
    rows = []
    for arm, r in results.items():
        gap = "—" if ref is None or arm == "kmeans-vq2" else \
            f"{100 * (r['nll_increase'] / ref['nll_increase'] - 1):+.0f} %"
        rows.append({"arm": arm, "bits/weight": round(r["bits_per_weight"], 4),
                     "rel. output error (calib)": round(r["err_cal"], 4),
                     "rel. output error (held-out)": round(r["err_heldout"], 4),
                     "held-out NLL": round(r["nll"], 4),
                     "NLL increase over fp32": round(r["nll_increase"], 4),
                     "gap vs k-means VQ-2": gap})
    verdict = _verdict(results)
    write_result(
        "docs/results/llm_unisvq", "UniSVQ-2 per-group A/b vs per-matrix vs k-means VQ-2, "
        f"SmolLM2-135M blocks {args.blocks} (no block fine-tuning)", columns, rows, verdict,
        extra={"args": vars(args), "fp_nll": fp_nll, "results": results, "blocks": blocks,
               "seconds": time.perf_counter() - t0})


def _verdict(results):
    if "kmeans-vq2" not in results or "unisvq2" not in results:
        return "Incomplete arm set; no verdict."
    km, base = results["kmeans-vq2"], results["unisvq2"]
    best = min((a for a in results if a.startswith("unisvq2")),
               key=lambda a: results[a]["nll_increase"])
    b = results[best]
    closed = (base["nll_increase"] - b["nll_increase"]) / max(
        base["nll_increase"] - km["nll_increase"], 1e-12)
    return (f"Per-matrix UniSVQ-2 adds {base['nll_increase']:.4f} nats over fp32 vs k-means VQ-2's "
            f"{km['nll_increase']:.4f}; the best UniSVQ variant ({best}, "
            f"{b['bits_per_weight']:.4f} vs {km['bits_per_weight']:.4f} bits/weight) adds "
            f"{b['nll_increase']:.4f}, closing {100 * closed:.0f} % of the gap "
            f"(held-out output error {b['err_heldout']:.4f} vs per-matrix "
            f"{base['err_heldout']:.4f} and k-means {km['err_heldout']:.4f}).")


if __name__ == "__main__":
    main()
