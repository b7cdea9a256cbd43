"""Arguments shared by the commands that load a real model (eval, generate), and the one way
they turn them into a model."""

from __future__ import annotations

import inspect

from lowrank_jax.runs.validate import non_negative_int, positive_float, positive_int


def library_default(fn, name: str):
    """The default of parameter ``name`` of ``fn`` (a function or a dataclass): a command's
    default read from the library constructor it calls, so the two never differ."""
    return inspect.signature(fn).parameters[name].default


def add_model_arguments(parser, *, kv_help: str) -> None:
    """``--model --dtype --projection --rank-ratio --attention --kv --kv-ratio --kv-group
    --kv-sink``."""
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2', a .gguf file, or a folder with config.json")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--projection", default="dense", choices=("dense", "factorized"))
    parser.add_argument("--rank-ratio", type=positive_float, default=None,
                        help="rank ratio for --projection factorized (default 0.5)")
    parser.add_argument("--attention", default="reference", choices=("reference", "flash", "sale"),
                        help="attention implementation (Pallas kernels: flash, sale)")
    from lowrank_jax.kv import KV_METHODS

    parser.add_argument("--kv", default="none", choices=tuple(KV_METHODS), help=kv_help)
    parser.add_argument("--kv-ratio", type=positive_float, default=8.0,
                        help="target KV-cache compression against the exact fp16 cache, every "
                             "byte counted; the method picks its ranks/bits to meet it")
    parser.add_argument("--kv-group", type=positive_int, default=None,
                        help="layers per xKV group (default 4, or the model's layer count when "
                             "it has fewer)")
    parser.add_argument("--kv-sink", type=non_negative_int, default=1,
                        help="leading prompt tokens kept exact by the --kv method (0 = the "
                             "papers' xKV / KIVI)")


def load_model_from_args(args):
    """``(model, tokenizer)`` from ``--model --dtype --projection --rank-ratio --attention``
    through :func:`lowrank_jax.hub.load_model` (GGUF, HF folder, quantized folder, PEFT
    adapter, preset); a clear error when there is no tokenizer."""
    from lowrank_jax.hub import load_model

    projection = getattr(args, "projection", "dense")
    model, tokenizer = load_model(
        args.model, dtype=getattr(args, "dtype", "float32"), projection=projection,
        rank_ratio=getattr(args, "rank_ratio", None) if projection == "factorized" else None,
        attention=getattr(args, "attention", "reference"),
    )
    if tokenizer is None:
        raise ValueError(f"--model {args.model}: the checkpoint has no tokenizer.json.")
    return model, tokenizer


def kv_factory_from_args(args, model):
    """The KV-cache factory of ``--kv --kv-ratio --kv-group --kv-sink`` for ``model``: an
    unset ``--kv-group`` is xKV's 4, or the model's layer count when it has fewer; a set one
    larger than the layer count is refused naming the flag."""
    from lowrank_jax.kv import kv_cache_factory
    from lowrank_jax.kv import DEFAULT_GROUP_SIZE

    layers = int(model.cfg.n_layers)
    group = getattr(args, "kv_group", None)
    if group is None:
        group = min(DEFAULT_GROUP_SIZE, layers)
    elif group > layers:
        raise ValueError(f"--kv-group {group} exceeds the model's {layers} layers; pass "
                         f"--kv-group between 1 and {layers}.")
    return kv_cache_factory(args.kv, args.kv_ratio, group, args.kv_sink)
