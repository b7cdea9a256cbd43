"""``lowrank-jax eval``: perplexity of a real checkpoint on a text file."""

from __future__ import annotations

import argparse
import os

from lowrank_jax.commands._common import add_model_arguments
from lowrank_jax.io.validate import check_text_file, positive_int


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
    from lowrank_jax.models.generate import english_eval_text, perplexity
    from lowrank_jax.models.hub import load_model

    if args.text is None:
        text, source = english_eval_text(), "bundled English license texts"
    else:
        if not os.path.isfile(args.text):
            raise FileNotFoundError(f"--text {args.text}: no such file.")
        text, source = check_text_file(args.text, "--text"), args.text
    from lowrank_jax.quant.model import is_quantized_folder, load_quantized

    if is_quantized_folder(args.model):  # a folder written by `lowrank-jax quantize`
        model, tokenizer = load_quantized(args.model)
    else:
        model, tokenizer = load_model(
            args.model, dtype=args.dtype, projection=args.projection,
            rank_ratio=args.rank_ratio if args.projection == "factorized" else None,
            attention=getattr(args, "attention", "reference"),
        )
    if tokenizer is None:
        raise ValueError(f"--model {args.model}: the checkpoint has no tokenizer.json.")
    ids = tokenizer.encode(text)
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens {args.max_tokens} must be at least 2.")
        ids = ids[: args.max_tokens]
    window = min(args.window, model.cfg.max_seq_len)
    if getattr(args, "kv", "none") == "xkv":
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
    import math

    from tqdm.auto import tqdm

    from lowrank_jax.kv import xkv_cache_factory

    eval_len = args.kv_eval_tokens
    if not 0 < eval_len < window - 1:
        raise ValueError(f"--kv-eval-tokens {eval_len} must lie in [1, window-2={window - 2}].")
    n_windows = len(ids) // window
    if n_windows == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}.")
    factory = xkv_cache_factory(args.kv_ratio, args.kv_group, args.kv_sink)
    logs = []
    for w in tqdm(range(n_windows), desc="xkv eval", disable=args.no_progress):
        chunk = ids[w * window:(w + 1) * window]
        ppl = factory.perplexity(model, chunk, context_len=window - eval_len - 1,
                                 eval_len=eval_len)
        logs.append(math.log(ppl))
    print(f"perplexity {math.exp(sum(logs) / len(logs)):.3f} with an xKV cache (ratio "
          f"{args.kv_ratio}, groups of {args.kv_group}, {args.kv_sink} exact sink token(s)): "
          f"{n_windows} window(s) of {window}, last {eval_len} tokens of each scored, "
          f"on {source}")
    return 0
