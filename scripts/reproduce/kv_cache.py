"""KV cache at 2-16x fewer bytes: exact, per-layer SVD, xKV, KIVI and xKV with quantized factors.

Every method meets its target ratio against the exact fp16 cache with all bytes counted
(factors, bases, scales, minima, exact sink / window tokens). For each window of English text
(``lowrank_jax.data.corpus_text()``), prefill ``--context`` tokens exactly, compress with each
method, and score the next ``--eval`` tokens attending to the rebuilt context plus the exact new
tokens (``lowrank_jax.kv.xkv_perplexity_sweep``, same protocol for all).

Held-out protocol: settings are chosen with ``--split explore`` (windows at odd eighths of the
corpus); the reported table uses ``--split heldout`` (windows at 0, 1/4, 1/2, 3/4), never used
for a choice.

Usage::

    python -m scripts.reproduce.kv_cache                         # held-out table + plot
    python -m scripts.reproduce.kv_cache --split explore --settings "xkv_quant:8:factor_bits=8"
    python -m scripts.reproduce.kv_cache --quick                 # 1 short window (plumbing)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tqdm import tqdm

from lowrank_jax.kv.evaluate import parse_setting, summarize_sweep
from lowrank_jax.kv.report import plot_sweep, record_line, sweep_table
from lowrank_jax.kv import SVDCache, prefill_kv, xkv_perplexity_sweep
from lowrank_jax.data import corpus_windows
from scripts._shared import load_model_and_codec

# (label, method, options): the curve's rows; every ratio in --ratios is tried for each
# (within a ratio the run goes in this order: the best combination first)
CURVE = [
    ("xKV, bits per singular direction (2/4/8, water-filling) + sink", "xkv_mixed", {}),
    ("xKV 8-bit K / 4-bit V factors, 256-token Hadamard groups + sink", "xkv_quant_wide", {}),
    ("xKV 8-bit K / 4-bit V Hadamard factors + sink", "xkv_quant_split", {}),
    ("xKV 4-bit Hadamard factors + sink", "xkv_quant_hadamard", {}),
    ("xKV 8-bit factors + sink", "xkv_quant", {}),
    ("xKV + sink", "xkv", {}),
    ("per-layer SVD + sink", "per_layer_svd", {}),
    ("KIVI", "kivi", {}),
]


# the run's order: the goal's ratios first, so that an interrupted run has the rows that matter
_PRIORITY = {8.0: 0, 16.0: 1, 4.0: 2, 2.0: 3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--split", default="heldout", choices=("heldout", "explore"))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--ratios", type=float, nargs="+", default=[2.0, 4.0, 8.0, 16.0])
    parser.add_argument("--methods", nargs="+", default=None,
                        help="only these methods of the curve (e.g. xkv_quant_split xkv)")
    parser.add_argument("--settings", nargs="*", default=None,
                        help="'method:ratio[:key=value,...]' instead of the curve")
    parser.add_argument("--quick", action="store_true", help="1 window of 256+32, ratios 2, 4")
    parser.add_argument("--out", default="runs/reproduce_kv_cache")
    parser.add_argument("--skip-exact", action="store_true",
                        help="leave out the exact row (a second process sharing a run)")
    parser.add_argument("--resume", action="store_true",
                        help="keep --out/records.json and skip the (setting, window) pairs it "
                             "already has (same windows and protocol)")
    parser.add_argument("--summarize", action="store_true",
                        help="only rebuild the table and plot from --out/records.json (e.g. "
                             "of an interrupted run)")
    args = parser.parse_args(argv)
    if args.summarize:
        return _summarize_only(args.out)
    if args.quick:
        args.windows, args.context, args.eval, args.ratios = 1, 256, 32, [2.0, 4.0]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    model, encode, _ = load_model_and_codec(args.model)
    length = args.context + args.eval + 1
    if args.split == "heldout":
        windows = corpus_windows(encode, args.windows, length)
    else:  # odd eighths of the corpus: disjoint from the held-out windows (at i/4)
        windows = corpus_windows(encode, 8, length)[1::2][: args.windows]
    labelled = [] if args.skip_exact else [("exact cache", dict(method="none", ratio=None))]
    if args.settings:
        labelled += [(s, parse_setting(s)) for s in args.settings]
    else:
        labelled += sorted(((label, dict(method=m, ratio=r, **opts))
                            for label, m, opts in CURVE for r in args.ratios
                            if args.methods is None or m in args.methods),
                           key=lambda item: _PRIORITY.get(item[1]["ratio"], 9))
    records = []
    if args.resume and os.path.exists(os.path.join(args.out, "records.json")):
        with open(os.path.join(args.out, "records.json")) as f:
            records = json.load(f)
    done = {(r["label"], r["target_ratio"], r["window"]) for r in records}
    shared = {}  # window -> (exact prefill K/V, SVDCache): one prefill and one SVD per group

    def window_state(w):
        if w not in shared:
            ids = np.asarray(windows[w])[None]
            shared[w] = (prefill_kv(model, ids[:, :args.context]), SVDCache())
        return shared[w]

    # settings outer, windows inner: an interrupted run still has whole rows (all windows)
    for label, setting in tqdm(labelled, desc="settings"):
        for w, ids in enumerate(windows):
            if (label, setting["ratio"], w) in done:
                continue
            prefill, svd_cache = window_state(w)
            t1 = time.time()
            try:
                rec = xkv_perplexity_sweep(model, ids, context_len=args.context,
                                           eval_len=args.eval, settings=[setting],
                                           prefill=prefill, svd_cache=svd_cache)[0]
            except ValueError as err:  # e.g. KIVI cannot reach 8x: say so, once
                records.append(dict(method=setting["method"], target_ratio=setting["ratio"],
                                    unreachable=str(err), label=label, window=w))
                print(record_line(label, records[-1]), flush=True)
                with open(os.path.join(args.out, "records.json"), "w") as f:
                    json.dump(records, f, indent=1, default=str)
                break
            records.append(dict(rec, label=label, window=w, seconds=time.time() - t1))
            print(record_line(label, records[-1]), flush=True)
            with open(os.path.join(args.out, "records.json"), "w") as f:
                json.dump(records, f, indent=1, default=str)
    rows = summarize_sweep(labelled, records)
    print("\n" + "\n".join(sweep_table(rows)))
    result = dict(model=args.model, split=args.split, windows=len(windows),
                  context=args.context, eval=args.eval, rows=rows, records=records,
                  seconds=time.time() - t0)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    plot_sweep(rows, os.path.join(args.out, "ppl_vs_bytes.png"))
    print(f"\nwrote {args.out}/results.json ({time.time() - t0:.0f} s)")
    return 0


def _summarize_only(out: str) -> int:
    with open(os.path.join(out, "records.json")) as f:
        records = json.load(f)
    labelled = []
    for r in records:
        key = (r["label"], r["target_ratio"])
        if key not in [(lab, st["ratio"]) for lab, st in labelled]:
            labelled.append((r["label"], dict(method=r["method"], ratio=r["target_ratio"])))
    rows = summarize_sweep(labelled, records)
    print("\n".join(sweep_table(sorted(rows, key=lambda r: (r["target"] or 0, r["label"])))))
    plot_sweep(rows, os.path.join(out, "ppl_vs_bytes.png"))
    print(f"wrote {out}/ppl_vs_bytes.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
