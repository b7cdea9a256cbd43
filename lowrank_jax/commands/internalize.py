"""``lowrank-jax internalize``: turn a document into a PEFT LoRA adapter with Doc-to-LoRA, so that
``lowrank-jax generate --model ADAPTER`` answers questions about it without the document."""

from __future__ import annotations

from lowrank_jax.runs.validate import positive_int


def register(subparsers) -> None:
    """Add the ``internalize`` subcommand."""
    p = subparsers.add_parser(
        "internalize", help="internalize a document into a LoRA adapter (Doc-to-LoRA)",
        description="Read --doc with the frozen model, generate a LoRA adapter with a Doc-to-LoRA "
                    "hypernetwork (--hyper, trained with lowrank_jax.hyper.train_doc_to_lora) "
                    "and write it as a PEFT adapter folder (--out).",
    )
    p.add_argument("--model", default="smollm2",
                   help="'smollm2', a .gguf file, a HF folder or a preset ('tiny')")
    p.add_argument("--doc", required=True, help="UTF-8 text file to internalize")
    p.add_argument("--out", required=True, help="adapter folder (PEFT format) to write")
    p.add_argument("--hyper", default=None,
                   help="trained hypernetwork folder; without it a freshly initialised one is "
                        "used, whose adapter is exactly a no-op (for plumbing checks)")
    p.add_argument("--chunk-len", type=positive_int, default=256,
                   help="tokens per chunk; each chunk adds rank (default 256)")
    p.add_argument("--layers", default=None,
                   help="comma-separated decoder layers for a fresh hypernetwork "
                        "(default: the middle quarter)")
    p.add_argument("--rank", type=positive_int, default=8, help="rank per chunk (fresh only)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.set_defaults(func=run)


def _layers(text: str | None, n_layers: int) -> list[int]:
    if text is None:
        lo = n_layers * 3 // 8
        return list(range(lo, max(lo + 1, n_layers * 5 // 8)))
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers {text!r}: give comma-separated integers, e.g. 8,12.") from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if not layers or bad:
        raise ValueError(f"--layers {text!r}: layers must lie in 0..{n_layers - 1}.")
    return layers


def run(args) -> int:
    import time

    from flax import nnx

    from lowrank_jax.commands._common import load_model_from_args
    from lowrank_jax.hyper import (
        DocToLoRA,
        export_generated_adapter,
        internalize,
        load_hypernetwork,
    )
    from lowrank_jax.runs import prepare_output
    from lowrank_jax.runs.validate import check_text_file
    from lowrank_jax.hub import SMOLLM2_HF_NAME

    text = check_text_file(args.doc, "--doc")
    if not text.strip():
        raise ValueError(f"--doc {args.doc}: the file is empty; give the document's text.")
    prepare_output(args.out, command="internalize", overwrite=args.overwrite,
                   reads={"--model": args.model, "--doc": args.doc, "--hyper": args.hyper})
    model, tokenizer = load_model_from_args(args)
    if args.hyper is not None:
        hyper = load_hypernetwork(args.hyper)
        c = hyper.config
        if c.d_model != model.cfg.d_model or max(c.layers) >= model.cfg.n_layers:
            raise ValueError(f"--hyper {args.hyper}: built for d_model={hyper.config.d_model}, "
                             f"layers {list(hyper.config.layers)}; --model {args.model} has "
                             f"d_model={model.cfg.d_model} and {model.cfg.n_layers} layers.")
    else:
        hyper = DocToLoRA.for_model(model, layers=_layers(args.layers, model.cfg.n_layers),
                                    rank=args.rank, rngs=nnx.Rngs(0))
        print("note: no --hyper given; a fresh hypernetwork writes a no-op adapter")
    tokens = tokenizer.encode(text, add_bos=False)
    start = time.perf_counter()
    bank = internalize(model, hyper, tokens, chunk_len=args.chunk_len)
    bank.a.block_until_ready()
    seconds = time.perf_counter() - start
    base = SMOLLM2_HF_NAME if args.model == "smollm2" else args.model
    config = export_generated_adapter(model, bank, hyper.config, args.out,
                                      base_model_name_or_path=base)
    chunks = -(-len(tokens) // args.chunk_len)
    print(f"internalized {len(tokens)} tokens ({chunks} chunks) in {seconds:.2f}s: rank "
          f"{config['r']} adapter on {len(hyper.config.layers)} x {hyper.config.target} -> "
          f"{args.out}")
    print(f"answer without the document: lowrank-jax generate --model {args.out} --prompt ...")
    return 0
