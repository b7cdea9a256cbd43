"""``lowrank-jax quantize``: UniSVQ 2-, 3- or 4-bit (or RTN) quantization of a Llama into a folder.

Example::

    lowrank-jax quantize --model smollm2 --bits 2 --method unisvq --out runs/smollm2-unisvq2
    lowrank-jax quantize --model smollm2 --bits 3 --method unisvq --out runs/smollm2-unisvq3
    lowrank-jax quantize --model smollm2 --bits 4 --method unisvq --out runs/smollm2-unisvq4
    lowrank-jax quantize --model smollm2 --bits 4 --method rtn --out runs/smollm2-rtn4

The folder (``quantization.json``, ``model.safetensors``, ``tokenizer.json``) loads with
:func:`lowrank_jax.quantize.load_quantized`.
"""

from __future__ import annotations

import argparse
import json
import os


from lowrank_jax.runs.validate import non_negative_int, positive_int

# the same as lowrank_jax.quantize.pipeline.METHOD_BITS (tested), without importing jax here
_METHOD_BITS = {"unisvq": (2, 3, 4), "rtn": (2, 3, 4, 8), "kmeans": (2,)}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "quantize", help="quantize every projection (UniSVQ 2-bit lattice, k-means VQ or RTN) "
        "into a folder"
    )
    parser.add_argument("--model", default="smollm2", help="name, .gguf file or HF folder")
    parser.add_argument("--method", default="unisvq", choices=sorted(_METHOD_BITS))
    parser.add_argument("--bits", type=int, default=2,
                        help="2, 3 or 4 (unisvq: {0..3}^4, {0..7}^4 or {0..15}^4 lattice); "
                        "2 (kmeans); "
                        "2, 3, 4, 8 (rtn)")
    parser.add_argument("--group-size", type=positive_int, default=64,
                        help="RTN input coordinates per scale/zero (must divide every input dim)")
    parser.add_argument("--zero-point", default="integer", choices=("integer", "float"),
                        help="RTN form: integer zero-point (standard) or fp16 float offset")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into an output folder that is not empty")
    parser.add_argument("--calib-file", default=None,
                        help="calibration text file (default: the stdlib-docstring corpus)")
    parser.add_argument("--calib-seqs", dest="n_seq", type=positive_int, default=32)
    parser.add_argument("--seq-len", type=positive_int, default=128)
    from lowrank_jax.commands._common import library_default
    from lowrank_jax.quant import UniSVQConfig

    parser.add_argument("--tune-iters", type=non_negative_int,
                        default=library_default(UniSVQConfig, "tune_iters"))
    parser.add_argument("--finetune-steps", type=non_negative_int,
                        default=library_default(UniSVQConfig, "finetune_steps"))
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="quantize only the first N blocks (quick runs)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax
    from flax import nnx

    from lowrank_jax.hub import save_model
    from lowrank_jax.models import projections
    from lowrank_jax.quantize import calibration_tokens, model_bits_per_weight, quantize_model
    from lowrank_jax.quant import UniSVQConfig

    allowed = _METHOD_BITS.get(args.method)
    if allowed is None:
        raise ValueError(f"--method {args.method!r} is unknown; use one of {sorted(_METHOD_BITS)}.")
    if args.bits not in allowed:
        raise ValueError(
            f"--bits {args.bits} is not supported by --method {args.method}; use one of {allowed}."
        )
    if args.calib_file is not None and not os.path.isfile(args.calib_file):
        raise FileNotFoundError(f"--calib-file {args.calib_file!r} does not exist.")
    from lowrank_jax.runs.validate import check_text_file

    check_text_file(args.calib_file, "--calib-file")
    from lowrank_jax.runs import prepare_output

    prepare_output(args.out, command="quantize", overwrite=args.overwrite,
                   reads={"--model": args.model, "--calib-file": args.calib_file})

    from lowrank_jax.hub import load_model

    model, tokenizer = load_model(args.model)
    n_params = sum(int(v.size) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    calib = None
    if args.method in ("unisvq", "kmeans"):
        if args.calib_file is not None:
            with open(args.calib_file, encoding="utf-8") as f:
                text = f.read()
        else:
            from lowrank_jax.data import corpus_text

            text = corpus_text()
        calib = calibration_tokens(tokenizer, text, args.n_seq, args.seq_len, args.seed)
    layers = None if args.layers is None else list(range(min(args.layers, model.cfg.n_layers)))
    cfg = UniSVQConfig(tune_iters=args.tune_iters, finetune_steps=args.finetune_steps,
                       seed=args.seed)
    report = quantize_model(model, calib, method=args.method, bits=args.bits,
                            group_size=args.group_size, zero_point=args.zero_point, cfg=cfg,
                            layers=layers, progress=True)
    from lowrank_jax.runs import staged_folder

    with staged_folder(args.out) as tmp:  # all or nothing (a full disk leaves no half model)
        save_model(model, tmp, tokenizer=tokenizer, report=report)
    summary = {k: report[k] for k in ("method", "bits", "bits_per_weight", "seconds")}
    summary["seconds_per_block"] = report["seconds"] / max(len(report["layers"]), 1)
    weights = os.path.join(args.out, "model.safetensors")
    summary["folder_mib"] = os.path.getsize(weights) / 2**20
    summary["fp16_mib"] = n_params * 2 / 2**20  # the dense model in fp16
    summary["folder_vs_fp16"] = summary["folder_mib"] / summary["fp16_mib"]
    # the quantized projections alone (embeddings and norms are kept in fp32 in the folder)
    n_proj = sum(lin.in_features * lin.out_features if hasattr(lin, "in_features")
                 else lin.kernel[...].size for *_, lin in projections(model))
    summary["projections_mib"] = model_bits_per_weight(model) * n_proj / 8 / 2**20
    summary["projections_fp16_mib"] = n_proj * 2 / 2**20
    print(json.dumps(summary))
    print(f"wrote {args.out}")
    return 0


__all__ = ["register", "run"]
