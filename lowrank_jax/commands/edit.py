"""``lowrank-jax edit``: apply counterfactual edits to a real model (CrispEdit, FT or LoRA) and
write the edited model as a folder every ``--model`` option reads."""

from __future__ import annotations

import json
import os

from lowrank_jax.runs.validate import positive_float, positive_int


def register(subparsers) -> None:
    from lowrank_jax.commands._common import library_default
    from lowrank_jax.editing import EditConfig, capability_data

    p = subparsers.add_parser(
        "edit", help="edit facts in a model with CrispEdit (or plain fine-tuning / LoRA)",
        description="Edit a model from a JSONL file of {prompt, target, paraphrases}; reports "
                    "edit success, paraphrase success and capability before/after.",
    )
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a HF folder")
    p.add_argument("--edits", required=True, help="JSONL: {prompt, target, paraphrases}")
    config = lambda name: library_default(EditConfig, name)  # noqa: E731
    data = lambda name: library_default(capability_data, name)  # noqa: E731
    p.add_argument("--gamma", type=float, default=config("gamma"),
                   help=f"curvature energy removed, in (0, 1] (default {config('gamma')})")
    p.add_argument("--method", default=config("method"),
                   choices=["crispedit", "finetune", "lora"])
    p.add_argument("--order", default=config("order"), choices=["strict", "faithful"],
                   help="strict: project after Adam (curvature bound); faithful: before")
    p.add_argument("--layers", default=config("layers"), help="regex over dense layer paths")
    p.add_argument("--steps", type=positive_int, default=config("steps"),
                   help=f"passes over the edits (default {config('steps')})")
    p.add_argument("--lr", type=positive_float, default=config("lr"))
    p.add_argument("--seq-len", type=positive_int, default=data("seq_len"))
    p.add_argument("--capability-seqs", type=positive_int, default=data("n_capability"))
    p.add_argument("--held-seqs", type=positive_int, default=data("n_held"))
    p.add_argument("--out", default="runs/edit",
                   help="folder for the edited model (loadable by eval/generate/--model) and "
                        "edit.json")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.set_defaults(func=run)


def run(args) -> int:
    from lowrank_jax import editing as ed
    from lowrank_jax.runs import prepare_output
    from lowrank_jax.runs.validate import check_regex, check_text_file
    from lowrank_jax.hub import load_model, save_model

    if not 0.0 < args.gamma <= 1.0:
        raise ValueError(f"--gamma {args.gamma} must lie in (0, 1], e.g. 0.9.")
    check_regex(args.layers, "--layers")
    check_text_file(args.edits, "--edits")
    prepare_output(args.out, command="edit", overwrite=args.overwrite,
                   reads={"--model": args.model, "--edits": args.edits})
    edits = ed.load_edits(args.edits)
    model, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise ValueError(f"--model {args.model}: no tokenizer found next to the checkpoint.")
    ed.matching_layers(model, args.layers)
    config = ed.EditConfig(method=args.method, layers=args.layers, gamma=args.gamma,
                           steps=args.steps, lr=args.lr, order=args.order)
    cap, held = ed.capability_data(tokenizer, seq_len=args.seq_len,
                                   n_capability=args.capability_seqs, n_held=args.held_seqs)
    before = ed.evaluate_edits(model, tokenizer, edits, held)
    log = ed.edit_model(model, tokenizer, edits, config, capability_batches=cap)
    after = ed.evaluate_edits(model, tokenizer, edits, held)
    print(f"{'metric':<22}{'before':>10}{'after':>10}")
    for k in before:
        print(f"{k:<22}{before[k]:>10.4f}{after[k]:>10.4f}")
    rel = (after["loss"] - before["loss"]) / before["loss"]
    print(f"relative capability loss change: {100 * rel:+.2f}%  ({log['epochs']} epochs)")
    save_model(model, args.out, tokenizer=tokenizer)
    with open(os.path.join(args.out, "edit.json"), "w") as f:
        json.dump({"config": vars(config) if hasattr(config, "__dict__") else str(config),
                   "before": before, "after": after, "log": log}, f, indent=2, default=str)
    print(f"wrote the edited model and edit.json to {args.out} (load it with --model {args.out})")
    return 0
