"""``lowrank-jax finetune``: LoRA fine-tuning (LoRA, BaLoRA, PiSSA, OLoRA, Gap-Init, LoKRA) on CPU.

Parses arguments and calls :func:`lowrank_jax.train.finetune.finetune` (or
:func:`lowrank_jax.train.jobs.run_jobs` with ``--jobs``); the adapter is saved in HuggingFace
PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
``peft.PeftModel.from_pretrained``.

``--mesh data=2,fsdp=4`` shards the model, adapters and optimizer state over a device mesh; the
same command runs as several processes (``lowrank-jax launch --processes 2 -- finetune --mesh
...``, or one per host of a pod / cluster): the adapter is gathered and written once, by
process 0.
"""

from __future__ import annotations

import json
import os

import numpy as np

from lowrank_jax.runs.validate import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from lowrank_jax.train.finetune import FALLBACK_LR, METHODS, default_lr


_PER_RUN = ("method", "quantize", "save_base", "data", "rank_plan", "rank", "alpha", "steps",
            "lr", "batch_size", "seq_len", "targets", "lokra_lambda", "seed", "save_merged")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune", help="LoRA fine-tuning (lora|balora|pissa|olora|gap|lokra), PEFT export",
        description="Fine-tune LoRA adapters on a text file and save them in HuggingFace PEFT "
                    "format. Only the adapters train; the base model stays frozen.",
    )
    p.add_argument("--model", default="tiny",
                   help="'smollm2' (the packaged GGUF), a .gguf / HF folder, or 'tiny' "
                        "(a small random byte-level Llama, for smoke tests)")
    p.add_argument("--quantize", default=None, choices=("nf4", "rtn4", "unisvq2"),
                   help="QLoRA: quantize the base first (NF4 64-blocks, RTN 4-bit groups of 64, "
                        "UniSVQ 2-bit Hessian-free lattice rounding); a quantized --model folder "
                        "needs no flag")
    p.add_argument("--save-base", default=None, metavar="DIR",
                   help="with --quantize: also write the quantized base as a folder (NF4, RTN-4 "
                        "or UniSVQ-2 codes + tokenizer) that --model DIR loads later")
    p.add_argument("--data", default=None,
                   help="UTF-8 text file to fine-tune on (default: the embedded byte corpus)")
    p.add_argument("--method", default="lora", choices=METHODS)
    p.add_argument("--rank-plan", action="store_true",
                   help="CSPLoRA: probe the base model and allocate per-module ranks under the "
                        "parameter budget of uniform --rank")
    p.add_argument("--rank", type=positive_int, default=8)
    p.add_argument("--alpha", type=positive_float, default=16.0)
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"learning rate (default {FALLBACK_LR:g}; {default_lr('balora'):g} for "
                        "balora)")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--targets", default=r"(q|v)_proj",
                   help="regex on module paths such as layers/3/self_attn/q_proj")
    p.add_argument("--lokra-lambda", type=non_negative_float, default=1e-3,
                   help="weight of the Kruskal-rank penalty (--method lokra)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--out", default="runs/finetune", help="output folder (adapter + metrics)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.add_argument("--mesh", default=None,
                   help="device mesh, e.g. data=2,fsdp=4 (default: one device); with several "
                        "processes (lowrank-jax launch, a pod, SLURM) it spans all of them")
    p.add_argument("--save-merged", default=None, metavar="DIR",
                   help="also save the model with the adapters merged into its weights (a HF "
                        "folder that --model reads)")
    p.add_argument("--jobs", default=None, metavar="JOBS.yaml",
                   help="train several LoRA jobs at once on one base (PLoRA packing); see "
                        "lowrank_jax/train/jobs.py for the file format")
    # with --jobs every job's settings come from the file: these flags would be ignored
    p.set_defaults(func=run, jobs_ignores={dest: p.get_default(dest) for dest in _PER_RUN})


def run(args) -> int:
    from lowrank_jax.runs.outputs import atomic_write_text, prepare_output, staged_folder
    from lowrank_jax.runs.validate import check_jobs_file, check_regex, check_text_file

    mesh = _mesh_of(args)
    if getattr(args, "jobs", None):
        from lowrank_jax.train.jobs import load_jobs, run_jobs

        if mesh is not None:
            raise ValueError("--jobs trains packed jobs on one device; drop --mesh (or --jobs).")
        ignored = [f"--{dest.replace('_', '-')}" for dest, default in args.jobs_ignores.items()
                   if getattr(args, dest) != default]
        if ignored:
            raise ValueError(
                f"--jobs takes every job's settings from {args.jobs}; {', '.join(ignored)} would "
                "be ignored. Put them in the file (per job: rank, alpha, lr, batch, data; for "
                "all jobs: targets, seq_len, steps, seed), or drop --jobs (it has no --quantize, "
                "--rank-plan or --save-merged).")

        jobs_out = check_jobs_file(args.jobs, args.out)[1]
        prepare_output(jobs_out, command="finetune", overwrite=args.overwrite,
                       reads={"--jobs": args.jobs, "--model": args.model})

        run_jobs(load_jobs(args.jobs), model=args.model, out=args.out,
                 progress=not args.no_progress, log=print)
        return 0
    from lowrank_jax.nn.rank_plan import plan_ranks
    from lowrank_jax.train import multihost
    from lowrank_jax.train.finetune import (
        export_adapter,
        finetune,
        load_model_and_tokens,
        save_merged,
        token_batches,
    )

    check_regex(args.targets, "--targets")
    check_text_file(args.data, "--data")
    multihost.on_main_process(  # files are written once, by process 0
        lambda: prepare_output(args.out, command="finetune", overwrite=args.overwrite,
                               reads={"--model": args.model, "--data": args.data}),
        what="checking --out")
    if getattr(args, "save_base", None) and not getattr(args, "quantize", None):
        raise ValueError("--save-base writes the quantized base; it needs --quantize "
                         "nf4|rtn4|unisvq2.")
    for flag in ("--save-base", "--save-merged"):  # extra outputs: the same rule as --out
        folder = getattr(args, flag[2:].replace("-", "_"), None)
        if folder:
            reads = {"--model": args.model, "--data": args.data, "--out": args.out}
            multihost.on_main_process(
                lambda folder=folder, flag=flag, reads=reads: prepare_output(
                    folder, command="finetune", argument=flag, overwrite=args.overwrite,
                    reads=reads),
                what=f"checking {flag}")
    lr = args.lr if args.lr is not None else default_lr(args.method)
    model, tokens, base_name = load_model_and_tokens(args.model, args.data)
    if getattr(args, "quantize", None):
        from lowrank_jax.hub import load_tokenizer, save_model
        from lowrank_jax.models.presets import PRESETS
        from lowrank_jax.quantize import quantize_base

        if args.method not in ("lora", "balora", "lokra"):
            raise ValueError(f"--method {args.method} rewrites the base weights; with --quantize "
                             "use lora, balora or lokra.")
        quantize_base(model, args.quantize)
        if args.save_base:
            with staged_folder(args.save_base) as tmp:  # all or nothing
                save_model(model, tmp, tokenizer=None if args.model in PRESETS
                           else load_tokenizer(args.model))
            print(f"quantized base: {args.save_base}")
    if len(tokens) < args.seq_len + 2:
        raise ValueError(f"--data has {len(tokens)} tokens, fewer than --seq-len + 2 = "
                         f"{args.seq_len + 2}; pass more text or a smaller --seq-len.")
    batch_fn = token_batches(tokens, args.batch_size, args.seq_len, args.seed)
    ranks, scores = None, None
    if args.rank_plan:
        probe = [batch_fn(10_000_000 + i) for i in range(8)]
        ranks, scores = plan_ranks(model, probe, targets=args.targets, average_rank=args.rank,
                                   r_min=max(1, args.rank // 4), r_max=4 * args.rank)
    result = finetune(model, batch_fn, method=args.method, targets=args.targets,
                      rank=args.rank, alpha=args.alpha, steps=args.steps, lr=lr,
                      seed=args.seed, ranks=ranks, lokra_lambda=args.lokra_lambda,
                      progress=not args.no_progress, description=f"finetune {args.method}",
                      mesh=mesh)
    adapter_dir = os.path.join(args.out, "adapter")
    config = export_adapter(model, adapter_dir,  # a preset's name: --model ADAPTER loads it
                            base_model_name_or_path=base_name or args.model,
                            initial_adapters=result.initial_adapters or None)
    main = multihost.is_main_process()  # export_adapter returns the config on process 0 only
    if main:  # the trained work is on disk before any last step that may fail
        summary = {
            "model": args.model, "method": args.method, "steps": args.steps, "lr": lr,
            "rank": args.rank, "alpha": args.alpha, "targets": args.targets,
            "first_loss": result.losses[0], "final_loss": float(np.mean(result.losses[-10:])),
            "seconds": result.seconds, "adapted_modules": len(result.adapted),
            "ranks": result.ranks, "probe_scores": scores, "peft_r": config["r"],
            "quantize": getattr(args, "quantize", None), "memory_bytes": result.memory,
        }
        atomic_write_text(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=2))
        atomic_write_text(os.path.join(args.out, "losses.json"), json.dumps(result.losses))
        print(f"{args.method}: loss {result.losses[0]:.4f} -> {summary['final_loss']:.4f} "
              f"(mean of the last 10 steps) in {args.steps} steps, {result.seconds:.1f} s; "
              f"{len(result.adapted)} modules adapted")
        print(f"PEFT adapter: {adapter_dir} (load with peft.PeftModel.from_pretrained)")
    if args.save_merged:  # PiSSA / OLoRA: the residual base plus the adapter, the tuned weight
        _save_merged(model, args, adapter_dir, save_merged)
        if main:
            print(f"merged model: {args.save_merged} (pass it as --model)")
    return 0


def _save_merged(model, args, adapter_dir: str, save_merged) -> None:
    """Write ``--save-merged`` (weights + the base's tokenizer) all or nothing; on a failure
    say that the adapter is kept and how to merge it later (a full disk: a user error, exit 2;
    anything else: an internal error, exit 1)."""
    from lowrank_jax.runs.outputs import describe_os_error, os_error_of, staged_folder
    from lowrank_jax.train import multihost

    try:
        tokenizer = _base_tokenizer(args.model)
        if multihost.is_main_process():
            with staged_folder(args.save_merged) as tmp:
                save_merged(model, tmp)
                if tokenizer is not None:  # --model DIR needs it (generate, eval)
                    tokenizer.save(tmp)
        else:
            save_merged(model, args.save_merged)  # the gather; process 0 writes
    except Exception as error:
        quantize = f" --quantize {args.quantize}" if getattr(args, "quantize", None) else ""
        kept = (f"the adapter and summary.json are saved in {args.out}; merge later with "
                f"`lowrank-jax merge --model {args.model}{quantize} --adapter {adapter_dir} "
                f"--to fp --out MERGED`")
        io_error = os_error_of(error)
        if io_error is not None:
            raise ValueError(f"--save-merged {args.save_merged}: not written "
                             f"({describe_os_error(io_error).rstrip('.')}); {kept}.") from error
        reason = str(error).splitlines()[0] if str(error) else ""
        raise RuntimeError(f"--save-merged {args.save_merged}: not written "
                           f"({type(error).__name__}: {reason}); {kept}.") from error


def _base_tokenizer(name: str):
    """The tokenizer of ``--model`` (a preset's bytes, a folder's ``tokenizer.json`` or byte
    marker, else what :func:`lowrank_jax.hub.load_model` returns: a GGUF's, an adapter's
    base's)."""
    from lowrank_jax.models.presets import PRESETS
    from lowrank_jax.models.tokenizer import ByteTokenizer, folder_tokenizer

    if name in PRESETS:
        return ByteTokenizer()
    tokenizer = folder_tokenizer(name) if os.path.isdir(name) else None
    if tokenizer is None:
        from lowrank_jax.hub import load_model

        tokenizer = load_model(name)[1]
    return tokenizer


def _mesh_of(args):
    """The ``--mesh`` (``None`` without one), after joining the other processes if any."""
    from lowrank_jax.train import sharding

    sharding.maybe_initialize_distributed()
    if not getattr(args, "mesh", None):
        return None
    sizes = sharding.parse_mesh(args.mesh)
    return sharding.make_mesh(sizes["data"], sizes["fsdp"], sizes["tensor"])
