"""``lowrank-jax eval``: perplexity of a real checkpoint on a text file."""

from __future__ import annotations

import argparse
import os

from lowrank_jax.commands._common import add_model_arguments, load_model_from_args
from lowrank_jax.runs.validate import check_text_file, positive_int


def register(subparsers) -> None:
    """Add the ``eval`` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="perplexity of a model (smollm2, a .gguf file or a HF folder) on a text file",
        description="Sliding-window perplexity of a real checkpoint on English text.",
    )
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file (default: the bundled English license texts)")
    parser.add_argument("--window", type=positive_int, default=1024,
                        help="tokens per forward pass")
    parser.add_argument("--stride", type=positive_int, default=None,
                        help="step between windows (default: --window, disjoint windows)")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="evaluate only the first N tokens")
    add_model_arguments(
        parser, kv_help='score each window from an xKV-compressed cache of its context')
    parser.add_argument("--kv-eval-tokens", type=positive_int, default=128,
                        help="with --kv: tokens scored per window after the compressed context")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, tokenize, evaluate, print one result line; returns the exit code."""
    from lowrank_jax.models import english_eval_text, perplexity

    if args.text is None:
        text, source = english_eval_text(), "bundled English license texts"
    else:
        if not os.path.isfile(args.text):
            raise FileNotFoundError(f"--text {args.text}: no such file.")
        text, source = check_text_file(args.text, "--text"), args.text
    model, tokenizer = load_model_from_args(args)
    ids = tokenizer.encode(text)
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens {args.max_tokens} must be at least 2.")
        ids = ids[: args.max_tokens]
    window = min(args.window, model.cfg.max_seq_len)
    if getattr(args, "kv", "none") != "none":
        return _eval_xkv(args, model, ids, window, source)
    result = perplexity(model, ids, window=window, stride=args.stride,
                        progress=not getattr(args, "no_progress", False))
    print(
        f"perplexity {result.perplexity:.3f} (nll {result.nll:.4f} nats/token) on "
        f"{result.n_tokens} tokens of {source}, {result.n_windows} window(s) of {window}"
    )
    return 0


def _eval_xkv(args, model, ids, window: int, source: str) -> int:
    """Per window: prefill ``window - kv_eval_tokens - 1`` tokens, compress, score the rest."""
    from lowrank_jax.commands._common import kv_factory_from_args
    from lowrank_jax.kv import xkv_windowed_perplexity

    factory = kv_factory_from_args(args, model)
    ppl, n_windows = xkv_windowed_perplexity(model, ids, factory, window=window,
                                             eval_len=args.kv_eval_tokens,
                                             progress=not args.no_progress)
    print(f"perplexity {ppl:.3f} with a {factory.describe()}: "
          f"{n_windows} window(s) of {window}, last {args.kv_eval_tokens} tokens of each scored, "
          f"on {source}")
    return 0
