"""``lowrank-jax generate``: stream a continuation of a prompt from a real checkpoint."""

from __future__ import annotations

import argparse
import sys

from lowrank_jax.commands._common import (
    add_model_arguments,
    library_default,
    load_model_from_args,
)
from lowrank_jax.runs.validate import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)


def register(subparsers) -> None:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text from a model (greedy or top-p sampling, KV cache, streaming)",
        description="Answer a prompt as a chat when the model has a chat template (--raw: "
                    "continue the text instead).",
    )
    parser.add_argument("--prompt", required=True, action="append",
                        help="the prompt text (repeat it, one per --adapter)")
    parser.add_argument("--adapter", action="append", default=None, metavar="DIR",
                        help="serve a PEFT LoRA adapter folder (repeatable: --adapter a "
                             "--adapter b with one --prompt each; all stay loaded, no recompile)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="wrap the prompt as a user message in the chat template (the "
                           "default when the model has one)")
    mode.add_argument("--raw", action="store_true",
                      help="continue the prompt text as is (no chat template)")
    from lowrank_jax.models import generate

    parser.add_argument("--max-new-tokens", type=positive_int,
                        default=library_default(generate, "max_new_tokens"))
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=positive_float, default=1.0,
                        help="nucleus mass in (0, 1] (with T > 0)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed")
    add_model_arguments(parser, kv_help="compress the prompt's KV cache with this method "
                                        "(lowrank_jax.kv.KV_METHODS)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, cache_factory=None) -> int:
    """Load, generate with streaming to stdout; returns the exit code.

    ``cache_factory`` is the hook for compressed KV caches (see
    :func:`lowrank_jax.models.generate.generate`).
    """
    import jax

    from lowrank_jax.models import generate

    model, tokenizer = load_model_from_args(args)
    if args.top_p > 1:
        raise ValueError(f"--top-p {args.top_p} must lie in (0, 1], e.g. 0.9.")
    if getattr(args, "adapter", None):
        return _serve(args, model, tokenizer)
    prompts = [args.prompt] if isinstance(args.prompt, str) else list(args.prompt)
    if len(prompts) > 1:
        raise ValueError("--prompt was given several times; that needs one --adapter each.")
    prompt = prompts[0]
    if args.chat or (not args.raw and getattr(tokenizer, "chat_template", None)):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])

    if getattr(args, "kv", "none") != "none":
        from lowrank_jax.commands._common import kv_factory_from_args
        from lowrank_jax.kv import generate_text_with_kv

        if args.temperature > 0:
            raise ValueError(f"--kv {args.kv} generates greedily; drop --temperature.")
        factory = kv_factory_from_args(args, model)
        print(generate_text_with_kv(model, tokenizer, prompt, factory,
                                    max_new_tokens=args.max_new_tokens))
        print(f"[{factory.describe()}]", file=sys.stderr)
        return 0

    def stream(token_id: int, piece: str) -> None:
        if token_id == tokenizer.eos_id:  # the end token ends the turn; do not print it
            return
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(
        model, tokenizer, prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, key=jax.random.key(args.seed),
        stream=stream, cache_factory=cache_factory,
    )
    sys.stdout.write("\n")
    reason = "end token" if result.stopped_at_eos else f"{len(result.token_ids)} new tokens"
    print(f"[stopped: {reason}]", file=sys.stderr)
    return 0


def _serve(args, model, tokenizer) -> int:
    """``generate --adapter DIR ...``: each adapter's answer, one batch, one compiled model."""
    import sys

    import jax

    from lowrank_jax.serve import generate_with_adapters

    if getattr(args, "kv", "none") != "none":
        raise ValueError("--adapter cannot be combined with --kv; drop one of them.")
    chat = args.chat or (not args.raw and getattr(tokenizer, "chat_template", None))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p
               for p in ([args.prompt] if isinstance(args.prompt, str) else args.prompt)]
    results = generate_with_adapters(
        model, tokenizer, prompts, args.adapter, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, key=jax.random.key(args.seed))
    for folder, result in zip(args.adapter, results):
        ids = [t for t in result.token_ids if t != tokenizer.eos_id]
        print(f"[adapter {folder}]")
        print(tokenizer.decode(ids))
    print(f"[{len(results)} adapter(s) resident, one batch, one compiled model]",
          file=sys.stderr)
    return 0
