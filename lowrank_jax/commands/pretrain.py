"""``lowrank-jax pretrain``: natively low-rank pretraining on the embedded corpus (the main job)
or on your own text (``--data PATH --tokenizer NAME``, read through grain)."""

from __future__ import annotations

import dataclasses

from lowrank_jax.runs.validate import positive_float, positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pretrain", help="pretrain a (factorized) Llama on the embedded corpus",
        description="Pretrain a natively low-rank byte-level Llama with Spectron (by default) on "
                    "the embedded corpus. Writes checkpoints, metrics.jsonl and loss.png to the "
                    "run folder.",
    )
    p.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on your text instead of the embedded corpus: a folder, file or "
                        "glob of .txt, .jsonl, .parquet or .arrayrecord files (data.path)")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="with --data: byte (default), smollm2, a .gguf, a tokenizer.json or a "
                        "model folder (data.tokenizer); model.vocab_size must hold its tokens")
    p.add_argument("--text-field", default=None, metavar="FIELD",
                   help="with --data: the JSON field / parquet column holding the text "
                        "(default text)")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--mesh", default=None,
                   help="device mesh, e.g. data=2,fsdp=2,tensor=2 (default: one device)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a run_dir holding another run (its checkpoints and "
                        "metrics are removed) or files of yours")
    p.add_argument("--stop-after", type=positive_int, default=None,
                   help="stop (with a checkpoint) after this many steps, as if interrupted")
    p.add_argument("--interrupt-timeout", type=positive_float, default=60.0, metavar="SECONDS",
                   help="after a SIGTERM, exit within this many seconds even when the process is "
                        "stuck in a collective (another process of a multi-host run is gone); "
                        "the interrupt checkpoint is then given up (default 60)")
    p.set_defaults(func=run)


def run(args) -> int:
    from lowrank_jax.runs import signals
    from lowrank_jax.train import load_config, multihost, sharding, train
    from lowrank_jax.train.config import MeshConfig

    # SIGTERM (a scheduler, a closed session): stop at the next step boundary with a checkpoint
    # and summary.json, exit 143; a second SIGTERM interrupts at once (exit 130)
    signals.install()
    multihost.install_interrupt_watchdog(args.interrupt_timeout)
    sharding.maybe_initialize_distributed()
    data_flags = [f"data.{key}={value}" for key, value in (
        ("path", args.data), ("tokenizer", args.tokenizer), ("text_field", args.text_field))
        if value is not None]
    if (args.tokenizer or args.text_field) and not args.data:
        raise ValueError("--tokenizer and --text-field apply to --data PATH; add --data (the "
                         "embedded corpus is read bytewise).")
    cfg = load_config(args.config, args.overrides + data_flags)
    if args.mesh:
        cfg = dataclasses.replace(cfg, mesh=MeshConfig(**sharding.parse_mesh(args.mesh)))
    result = train(cfg, resume=args.resume, stop_after=args.stop_after,
                   progress=not args.no_progress, overwrite=args.overwrite)
    ratio = result.val_bits_per_byte / result.unigram_entropy_bits
    unit = result.unit
    print(f"validation loss: {result.val_loss:.4f} nats/{unit} = "
          f"{result.val_bits_per_byte:.3f} bits/{unit}")
    print(f"unigram {unit} entropy of the {'corpus' if args.data is None else 'held-out text'}: "
          f"{result.unigram_entropy_bits:.3f} bits/{unit} (model/entropy = {ratio:.2f})")
    print(f"run folder: {result.run_dir} (checkpoints/, metrics.jsonl, loss.png, summary.json)")
    return 0
