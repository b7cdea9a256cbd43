"""``lowrank-jax merge``: fold a LoRA / QLoRA adapter into its base, reporting what it costs.

``--to fp`` writes a dense HF folder holding ``W + s A B`` (exact); ``--to quantized``
re-quantizes ``W + s A B`` with the base's own method and writes a quantized folder, printing
the held-out perplexity of the adapter on its base and of the merged model (the error the
re-quantization adds) — see :mod:`lowrank_jax.nn.merge`.
"""

from __future__ import annotations

import json
import os

from lowrank_jax.runs.validate import positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "merge", help="merge a (Q)LoRA adapter into fp or a re-quantized base; reports ppl",
        description="Merge a PEFT adapter into its base model: into fp (exact) or into a "
                    "re-quantized base, with the perplexity before and after.",
    )
    p.add_argument("--model", required=True,
                   help="the base: 'smollm2', a .gguf / HF folder, a quantized folder, 'tiny'")
    p.add_argument("--quantize", default=None, choices=("nf4", "rtn4", "unisvq2"),
                   help="quantize the base first (as `finetune --quantize` did)")
    p.add_argument("--adapter", required=True, metavar="DIR", help="PEFT adapter folder")
    p.add_argument("--to", default="quantized", choices=("fp", "quantized"))
    p.add_argument("--data", default=None,
                   help="held-out UTF-8 text for perplexity (default: the shipped English text)")
    p.add_argument("--eval-tokens", type=positive_int, default=2048)
    p.add_argument("--out", required=True, help="output folder (merged model + report.json)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    import numpy as np

    from lowrank_jax.io.adapters import read_adapter
    from lowrank_jax.runs import atomic_write_text, prepare_output, staged_folder
    from lowrank_jax.io import import_peft
    from lowrank_jax.runs.validate import check_text_file
    from lowrank_jax.models import english_eval_text, perplexity
    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.nn.merge import merge_report
    from lowrank_jax.quantize import quantize_base

    check_text_file(args.data, "--data")
    if not os.path.isdir(args.adapter):
        raise FileNotFoundError(f"--adapter {args.adapter}: no such folder; pass a PEFT adapter "
                                "folder (adapter_config.json + adapter_model.safetensors).")
    prepare_output(args.out, command="merge", overwrite=args.overwrite,
                   reads={"--model": args.model, "--adapter": args.adapter, "--data": args.data})
    read_adapter(args.adapter, who=f"--adapter {args.adapter}")  # before any model loads
    model, tokenizer = load_model(args.model)
    if args.quantize:
        quantize_base(model, args.quantize)
    import_peft(model, args.adapter)
    if args.data is None:
        text = english_eval_text()
    else:
        with open(args.data, encoding="utf-8") as f:
            text = f.read()
    if tokenizer is not None:
        ids = np.asarray(tokenizer.encode(text), np.int32)
    else:
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    ids = ids[: args.eval_tokens]
    if len(ids) < 2:
        raise ValueError("--data holds fewer than 2 tokens; pass more held-out text.")
    window = min(256, model.cfg.max_seq_len, len(ids))
    merged, report = merge_report(
        model, lambda m: perplexity(m, ids, window=window, progress=False).perplexity,
        target=args.to)
    model_dir = os.path.join(args.out, "model")
    with staged_folder(model_dir) as tmp:  # all or nothing (a full disk leaves no half model)
        save_model(merged, tmp, tokenizer=tokenizer)  # fp: HF folder; quantized: its folder
    report["saved"] = model_dir
    atomic_write_text(os.path.join(args.out, "report.json"), json.dumps(report, indent=2))
    print(f"merge --to {args.to}: perplexity {report['ppl_adapter']:.3f} (adapter on its base) "
          f"-> {report['ppl_merged']:.3f} merged ({report['ppl_added']:+.3f}); mean relative "
          f"weight error {report['layer_error_mean']:.2e} over {report['layers']} layers")
    return 0
