"""Reproduce UniSVQ's claim on SmolLM2-135M against the right baselines, whole model, one run.

One run measures, on the same model and the same held-out eval text:
fp32; RTN 4/3/2-bit (group 64, standard integer zero-point; RTN-3 also in the float-offset
variant); the best scalar 2-bit (RHT + the same Hessians + LDLQ, per-group fp16 scales,
``lowrank_jax.quant.scalar_ldlq``); k-means VQ-2 (d=4, 256 codes, same RHT + LDLQ, without and
with the same block fine-tuning); UniSVQ-2 without and with block fine-tuning; UniSVQ-3 (the
``{0..7}⁴`` lattice, 4096 codewords, same RHT + LDLQ + block fine-tuning); and, on the saved
folders, an end-to-end pass (``e2e``: UniSVQ-2, ``e2e-kmeans``, ``e2e-unisvq3``). Bits per
weight are exact. The no-fine-tuning rows come from the same run as the fine-tuned ones (the
codes do not depend on fine-tuning; ``quantize_model(keep_unfinetuned=True)``). Whole-model
quantization wall time and CPU time are printed per method.

Calibration: the stdlib-docstring corpus (``lowrank_jax.data.corpus_text``); evaluation: the
shipped English license text (``lowrank_jax.models.generate.english_eval_text``), disjoint.

Usage::

    python -m scripts.reproduce.unisvq            # all 30 blocks, every method, one process
    python -m scripts.reproduce.unisvq --only unisvq   # one method (its rows: OUT/rows/*.json)
    python -m scripts.reproduce.unisvq --only e2e      # end-to-end pass on OUT/unisvq2
    python -m scripts.reproduce.unisvq --only unisvq3,e2e-unisvq3   # the 3-bit lattice
    python -m scripts.reproduce.unisvq --only unisvq4,e2e-unisvq4   # the 4-bit lattice
    python -m scripts.reproduce.unisvq --table-only    # merge the saved rows of this protocol

CPU seconds measured for 30 blocks (2 cores, round 5): UniSVQ-2 413 (285 with
``--finetune-steps 20``), UniSVQ-3 421, UniSVQ-4 427, k-means VQ 695-761, scalar LDLQ 332-343,
RTN a few; a 20-step e2e pass about 270; each quantized model's evaluation adds about a minute.
The ≤ 10-min 2-bit method (553 CPU s)::

    python -m scripts.reproduce.unisvq --out runs/reproduce_unisvq_ft20 --finetune-steps 20 \
        --only unisvq,e2e --e2e-steps 20
    python -m scripts.reproduce.unisvq --quick    # the first 4 blocks only, fewer steps
    python -m scripts.reproduce.unisvq --model tiny --quick   # smoke test (seconds)

References:
    Wang et al, `UniSVQ: 2-bit Unified Scalar-Vector Quantization
    <https://arxiv.org/abs/2606.10520>`_, 2026.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--sq-group-size", type=int, default=192,
                   help="scalar-LDLQ group (2 + 16/g bits; 192 gives 2.083 vs UniSVQ's 2.047)")
    p.add_argument("--tune-iters", type=int, default=3)
    p.add_argument("--finetune-steps", type=int, default=40)
    p.add_argument("--no-kmeans", action="store_true")
    p.add_argument("--only", default=None,
                   help="comma-separated methods to run (rtn, sq-ldlq, kmeans, unisvq, unisvq3, "
                   "unisvq4, e2e, e2e-kmeans, e2e-unisvq3, e2e-unisvq4); default all")
    p.add_argument("--no-ablation", action="store_true",
                   help="skip UniSVQ without fine-tuning")
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: merge the rows already in OUT/rows/ into the table")
    p.add_argument("--no-folder", action="store_true",
                   help="do not write (and chat with) the folders OUT/unisvq2, unisvq3, kmeans2")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--e2e-steps", type=int, default=20,
                   help="steps of the end-to-end passes (e2e*, on the saved folders)")
    return p.parse_args(argv)


FOLDERS = {"unisvq": "unisvq2", "unisvq3": "unisvq3", "unisvq4": "unisvq4", "kmeans": "kmeans2"}
E2E_SOURCES = {"e2e": "unisvq", "e2e-kmeans": "kmeans", "e2e-unisvq3": "unisvq3",
               "e2e-unisvq4": "unisvq4"}
LATTICE_RUNS = {"unisvq3": 3, "unisvq4": 4}  # --only name -> bits of the UniSVQ lattice


def run_e2e(args, fp_model, calib, ppl, source_rows, source: str, tokenizer,
            n_params: int) -> tuple[dict, dict | None]:
    """The end-to-end pass on the folder of ``source`` (this protocol): load, tune the continuous
    parameters against the fp model on the calibration tokens, evaluate, save the tuned folder
    (``OUT/<folder>-e2e``) and chat with it; one table row and the folder record."""
    from lowrank_jax.bench.timing import cpu_usage
    from lowrank_jax.cli import save_and_check
    from lowrank_jax.hub import load_model
    from lowrank_jax.quantize.e2e import finetune_end_to_end

    if source_rows is None or not source_rows.get("folder"):
        raise ValueError(f"the e2e pass on {source} needs its folder of the same protocol; run "
                         f"--only {source} first (without --no-folder).")
    model_q, _ = load_model(source_rows["folder"]["path"])
    with cpu_usage() as usage:
        info = finetune_end_to_end(model_q, fp_model, calib, steps=args.e2e_steps,
                                   log=lambda line: print(line, flush=True))
    info.update(usage)
    base = source_rows["rows"][-1]
    value = ppl(model_q)
    print(f"{base['method']} + {args.e2e_steps}-step e2e: ppl {value:.3f} "
          f"(val KL {info['val_kl_before']:.4f} -> {info['val_kl_after']:.4f}, "
          f"e2e time {info['seconds']:.1f}s wall, {info['cpu_seconds']:.1f}s CPU, load average "
          f"{info['load_average'][0]:.1f} -> {info['load_average'][1]:.1f}); whole pipeline "
          f"(block-wise + e2e) {source_rows['rows'][-1]['cpu_seconds'] + info['cpu_seconds']:.1f}"
          "s CPU", flush=True)
    row = {"method": f"{base['method']} + {args.e2e_steps}-step e2e (KL)",
           "bits_per_weight": base["bits_per_weight"], "ppl": value,
           "seconds": base["seconds"] + info["seconds"],
           "cpu_seconds": base["cpu_seconds"] + info["cpu_seconds"],
           "median_block_seconds": base["median_block_seconds"], "e2e": info}
    folder = None if args.no_folder else save_and_check(
        model_q, source_rows["folder"]["path"] + "-e2e", n_params=n_params, tokenizer=tokenizer,
        max_new_tokens=args.max_new_tokens)
    return row, folder


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    from flax import nnx

    from lowrank_jax.analysis.report import plot_bars
    from lowrank_jax.bench.timing import cpu_usage
    from lowrank_jax.cli import save_and_check
    from lowrank_jax.data import corpus_text
    from lowrank_jax.hub import load_model
    from lowrank_jax.runs.outputs import atomic_write_text
    from lowrank_jax.runs.results import RecordFolder, markdown_table
    from lowrank_jax.models import perplexity
    from lowrank_jax.models.llama import projections
    from lowrank_jax.quantize.pipeline import (
        FINETUNED,
        calibration_tokens,
        quantize_model,
        unfinetuned_model,
    )
    from lowrank_jax.quant.scalar_ldlq import dividing_sq_group
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
    sq_group = dividing_sq_group(args.sq_group_size, {lin.in_features
                                                      for *_, lin in projections(model)})
    if sq_group != args.sq_group_size:  # e.g. the tiny preset's 64-wide rows
        print(f"note: --sq-group-size {args.sq_group_size} does not divide every input dim of "
              f"{args.model}; scalar LDLQ uses g{sq_group}")
        args.sq_group_size = sq_group

    calib = calibration_tokens(tok, corpus_text(), args.calib_seqs, args.seq_len, seed=0)
    try:
        from lowrank_jax.models.generate import english_eval_text

        eval_text, eval_source = english_eval_text(), "english_eval_text (licenses + Zen)"
    except ImportError:  # DERIVED fallback: a slice of the corpus disjoint from calibration
        eval_text, eval_source = corpus_text()[-200_000:], "corpus tail"
    eval_ids = np.asarray(tok.encode(eval_text), np.int32)[: args.eval_tokens + 1]
    eval_seq = min(256, model.cfg.max_seq_len - 1)
    print(f"calibration {calib.shape} tokens of the stdlib corpus; eval {len(eval_ids) - 1} "
          f"tokens of {eval_source}; blocks quantized: {len(layers)}/{n_layers}")

    graph, fp_state = nnx.split(model)
    n_fp_params = sum(int(v.size) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))

    def fresh():
        return nnx.merge(graph, jax.tree.map(lambda a: a, fp_state))

    windows = (len(eval_ids) - 1) // eval_seq  # disjoint windows, each scores eval_seq tokens

    def ppl(m):
        return perplexity(m, eval_ids[: windows * eval_seq + 1], window=eval_seq + 1,
                          stride=eval_seq, progress=False).perplexity

    rows_dir = os.path.join(args.out, "rows")
    # every row file records the protocol; the table merges only rows of the same protocol
    fingerprint = {"model": args.model, "layers": layers, "calibration_shape": list(calib.shape),
                   "eval_tokens": int(windows * eval_seq), "eval_source": eval_source,
                   "group_size": args.group_size, "sq_group_size": args.sq_group_size,
                   "tune_iters": args.tune_iters, "finetune_steps": args.finetune_steps}
    store = RecordFolder(rows_dir, fingerprint)
    if store.read("fp32") is None and not args.table_only:
        t = time.perf_counter()
        fp_value = ppl(fresh())
        store.write("fp32", rows=[{"method": "fp32", "bits_per_weight": 32.0, "ppl": fp_value,
                                   "seconds": 0.0, "cpu_seconds": 0.0,
                                   "median_block_seconds": 0.0}])
        print(f"fp32 ppl {fp_value:.3f} ({time.perf_counter() - t:.1f}s)")

    base_cfg = UniSVQConfig(tune_iters=args.tune_iters, finetune_steps=args.finetune_steps)
    ft = args.finetune_steps
    runs = [("RTN-4 (g64, int zero)", "rtn", 4, "integer"), ("RTN-3 (g64, int zero)", "rtn", 3,
             "integer"), ("RTN-3 (g64, float offset)", "rtn", 3, "float"),
            ("RTN-2 (g64, int zero)", "rtn", 2, "integer"),
            (f"scalar LDLQ-2 (RHT, g{args.sq_group_size})", "sq-ldlq", 2, None)]
    if not args.no_kmeans:
        runs.append(("k-means VQ-2 (RHT+LDLQ)", "kmeans", 2, None))
    runs.append(("UniSVQ-2 (RHT+LDLQ)", "unisvq", 2, None))
    runs.append(("UniSVQ-3 (RHT+LDLQ)", "unisvq3", 3, None))
    runs.append(("UniSVQ-4 (RHT+LDLQ)", "unisvq4", 4, None))
    runs += [(name, name, 0, None) for name in E2E_SOURCES
             if not (args.no_kmeans and name == "e2e-kmeans")]
    if args.only:
        keep = {m.strip() for m in args.only.split(",")}
        unknown = keep - {r[1] for r in runs}
        if unknown:
            raise ValueError(f"--only {sorted(unknown)}: unknown; use "
                             f"{', '.join(r[1] for r in runs if r[1] != 'rtn')}, rtn.")
        runs = [r for r in runs if r[1] in keep]
    if args.table_only:
        runs = []

    method_rows: dict[str, list] = {}
    for name, method, bits, zero_point in runs:
        if method in E2E_SOURCES:
            row, folder = run_e2e(args, fresh(), calib, ppl, store.read(E2E_SOURCES[method]),
                                  E2E_SOURCES[method], tok, n_fp_params)
            method_rows[method] = [row]
            store.write(method, rows=method_rows[method], **({"folder": folder} if folder else {}))
            continue
        m = fresh()
        qmethod = "unisvq" if method in LATTICE_RUNS else method
        with cpu_usage() as usage:  # CPU seconds and the 1-min load average at start and end
            report = quantize_model(m, calib, method=qmethod, bits=bits,
                                    group_size=args.group_size, zero_point=zero_point or "integer",
                                    sq_group_size=args.sq_group_size, cfg=base_cfg, layers=layers,
                                    keep_unfinetuned=qmethod in FINETUNED and ft > 0)
        cpu, load = usage["cpu_seconds"], usage["load_average"]
        variants = [(name if qmethod not in FINETUNED or ft == 0 else f"{name} + {ft}-step "
                     "block FT", m)]
        if "unfinetuned" in report:
            variants.insert(0, (f"{name}, no FT", unfinetuned_model(m, report)))
        per_block = [b["seconds"] for b in report["blocks"]]
        for label, model_q in variants:
            value = ppl(model_q)
            method_rows.setdefault(method, []).append({
                "method": label, "bits_per_weight": report["bits_per_weight"],
                "ppl": value, "seconds": report["seconds"], "cpu_seconds": cpu,
                "median_block_seconds": float(np.median(per_block)) if per_block else 0.0,
                "load_average": load, "blocks": report["blocks"],
            })
            print(f"{label}: ppl {value:.3f}, {report['bits_per_weight']:.4f} bpw, "
                  f"{report['seconds']:.1f}s wall, {cpu:.1f}s CPU (load average "
                  f"{load[0]:.1f} -> {load[1]:.1f})", flush=True)
        extra = {}
        if method in FOLDERS and not args.no_folder:
            extra["folder"] = save_and_check(
                m, os.path.join(args.out, FOLDERS[method]), n_params=n_fp_params, tokenizer=tok,
                report=report, max_new_tokens=args.max_new_tokens,
                eval_tokens=int(windows * eval_seq))
        store.write(method, rows=method_rows[method], **extra)

    order = ["fp32", "rtn", "sq-ldlq", "kmeans", "e2e-kmeans", "unisvq", "e2e", "unisvq3",
             "e2e-unisvq3", "unisvq4", "e2e-unisvq4"]
    saved = {k: store.read(k) for k in order}
    missing = [k for k, v in saved.items() if v is None]
    if saved["fp32"] is None:
        raise ValueError(f"{rows_dir}: no fp32 row for this protocol; run without --table-only.")
    rows = [r for k in order if saved[k] is not None for r in saved[k]["rows"]]
    fp_ppl = saved["fp32"]["rows"][0]["ppl"]
    columns = ["method", "bits/weight (quantized projections)", "PPL", "PPL / fp32",
               "quant wall s", "quant CPU s", "median s/block"]
    table = "\n".join(markdown_table(columns, [dict(zip(columns, [
        r["method"], f"{r['bits_per_weight']:.4f}", f"{r['ppl']:.2f}", f"{r['ppl'] / fp_ppl:.2f}",
        *(["–"] * 3 if r["method"] == "fp32" else [f"{r[k]:.1f}" for k in (
            "seconds", "cpu_seconds", "median_block_seconds")])])) for r in rows]))
    print(table)
    if missing:
        print(f"(not in the table yet, run with --only: {', '.join(missing)})")
    folders = {k: saved[k]["folder"] for k in order if (saved[k] or {}).get("folder")}
    for k, folder in folders.items():
        print(f"{k} folder {folder['path']}: {folder['folder_mib']:.1f} MiB on disk vs "
              f"{folder['fp16_mib']:.1f} MiB fp16 ({folder['folder_vs_fp16']:.3f}x); chat "
              f"answer: {folder['answer']!r}"
              + (f"; eval: {folder['cli_eval']}" if folder.get("cli_eval") else ""))
    result = {
        "args": vars(args), "fingerprint": fingerprint, "rows": rows, "table": table,
        "missing": missing, "folder": folders.get("unisvq"), "folders": folders,
    }
    atomic_write_text(os.path.join(args.out, "results.json"), json.dumps(result, indent=1))
    plot_bars([r["method"] for r in rows], [r["ppl"] for r in rows],
              os.path.join(args.out, "perplexity.png"), ylabel="perplexity (log)", yscale="log",
              title=f"{args.model}: {len(layers)}/{n_layers} blocks quantized")
    print(f"wrote {args.out}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
