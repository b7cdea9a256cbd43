"""``lowrank-jax eval``: perplexity of a real checkpoint on a text file."""

from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    """Add the ``eval`` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="perplexity of a model (smollm2, a .gguf file or a HF folder) on a text file",
        description="Sliding-window perplexity of a real checkpoint on English text.",
    )
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2', a .gguf file, or a folder with config.json")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file (default: the bundled English license texts)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward pass")
    parser.add_argument("--stride", type=int, default=None,
                        help="step between windows (default: --window, disjoint windows)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="evaluate only the first N tokens")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--projection", default="dense", choices=("dense", "factorized"))
    parser.add_argument("--rank-ratio", type=float, default=None,
                        help="rank ratio for --projection factorized (default 0.5)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, tokenize, evaluate, print one result line; returns the exit code."""
    from lowrank_jax.models.generate import english_eval_text, perplexity
    from lowrank_jax.models.hub import load_model

    if args.text is None:
        text, source = english_eval_text(), "bundled English license texts"
    else:
        if not os.path.isfile(args.text):
            raise FileNotFoundError(f"--text {args.text}: no such file.")
        with open(args.text, encoding="utf-8") as f:
            text, source = f.read(), args.text
    model, tokenizer = load_model(
        args.model, dtype=args.dtype, projection=args.projection,
        rank_ratio=args.rank_ratio if args.projection == "factorized" else None,
    )
    if tokenizer is None:
        raise ValueError(f"--model {args.model}: the checkpoint has no tokenizer.json.")
    ids = tokenizer.encode(text)
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens {args.max_tokens} must be at least 2.")
        ids = ids[: args.max_tokens]
    window = min(args.window, model.cfg.max_seq_len)
    result = perplexity(model, ids, window=window, stride=args.stride,
                        progress=not getattr(args, "no_progress", False))
    print(
        f"perplexity {result.perplexity:.3f} (nll {result.nll:.4f} nats/token) on "
        f"{result.n_tokens} tokens of {source}, {result.n_windows} window(s) of {window}"
    )
    return 0
