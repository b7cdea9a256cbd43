"""``lowrank-jax finetune``: LoRA fine-tuning (LoRA, BaLoRA, PiSSA, OLoRA, Gap-Init, LoKRA) on CPU.

Parses arguments into a :class:`lowrank_jax.train.job.FinetuneJob` (its defaults are the
command's) and runs it; the adapter is saved in HuggingFace PEFT format
(``adapter_config.json`` + ``adapter_model.safetensors``), loadable with
``peft.PeftModel.from_pretrained``. ``--jobs JOBS.yaml`` is ``lowrank-jax jobs JOBS.yaml``.

``--mesh data=2,fsdp=4`` shards the model, adapters and optimizer state over a device mesh; the
same command runs as several processes (``lowrank-jax launch --processes 2 -- finetune --mesh
...``, or one per host of a pod / cluster): the adapter is gathered and written once, by
process 0.
"""

from __future__ import annotations

from lowrank_jax.commands._common import library_default
from lowrank_jax.runs.validate import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from lowrank_jax.train.finetune import FALLBACK_LR, FINETUNE_METHODS, default_lr
from lowrank_jax.train import FinetuneJob
from lowrank_jax.train.job import QUANTIZE

# the flags that map one to one onto FinetuneJob's fields (--no-progress is progress=False)
_JOB_FIELDS = ("model", "quantize", "save_base", "data", "method", "rank_plan", "rank", "alpha",
               "steps", "lr", "batch_size", "seq_len", "targets", "lokra_lambda", "seed", "out",
               "overwrite", "mesh", "save_merged")
# with --jobs, the settings of one run: the jobs file holds them, so they are refused
_PER_RUN = ("method", "quantize", "save_base", "data", "rank_plan", "rank", "alpha", "steps",
            "lr", "batch_size", "seq_len", "targets", "lokra_lambda", "seed", "save_merged")


def _default(name: str):
    return library_default(FinetuneJob, name)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune", help="LoRA fine-tuning (lora|balora|pissa|olora|gap|lokra), PEFT export",
        description="Fine-tune LoRA adapters on a text file and save them in HuggingFace PEFT "
                    "format. Only the adapters train; the base model stays frozen.",
    )
    p.add_argument("--model", default=_default("model"),
                   help="'smollm2' (the packaged GGUF), a .gguf / HF folder, or 'tiny' "
                        "(a small random byte-level Llama, for smoke tests)")
    p.add_argument("--quantize", default=_default("quantize"), choices=QUANTIZE,
                   help="QLoRA: quantize the base first (NF4 64-blocks, RTN 4-bit groups of 64, "
                        "UniSVQ 2-bit Hessian-free lattice rounding); a quantized --model folder "
                        "needs no flag")
    p.add_argument("--save-base", default=_default("save_base"), metavar="DIR",
                   help="with --quantize: also write the quantized base as a folder (NF4, RTN-4 "
                        "or UniSVQ-2 codes + tokenizer) that --model DIR loads later")
    p.add_argument("--data", default=_default("data"),
                   help="UTF-8 text file to fine-tune on (default: the embedded byte corpus)")
    p.add_argument("--method", default=_default("method"), choices=FINETUNE_METHODS)
    p.add_argument("--rank-plan", action="store_true",
                   help="CSPLoRA: probe the base model and allocate per-module ranks under the "
                        "parameter budget of uniform --rank")
    p.add_argument("--rank", type=positive_int, default=_default("rank"))
    p.add_argument("--alpha", type=positive_float, default=_default("alpha"))
    p.add_argument("--steps", type=positive_int, default=_default("steps"))
    p.add_argument("--lr", type=positive_float, default=_default("lr"),
                   help=f"learning rate (default {FALLBACK_LR:g}; {default_lr('balora'):g} for "
                        "balora)")
    p.add_argument("--batch-size", type=positive_int, default=_default("batch_size"))
    p.add_argument("--seq-len", type=positive_int, default=_default("seq_len"))
    p.add_argument("--targets", default=_default("targets"),
                   help="regex on module paths such as layers/3/self_attn/q_proj")
    p.add_argument("--lokra-lambda", type=non_negative_float, default=_default("lokra_lambda"),
                   help="weight of the Kruskal-rank penalty (--method lokra)")
    p.add_argument("--seed", type=non_negative_int, default=_default("seed"))
    p.add_argument("--out", default=_default("out"), help="output folder (adapter + metrics)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.add_argument("--mesh", default=_default("mesh"),
                   help="device mesh, e.g. data=2,fsdp=4 (default: one device); with several "
                        "processes (lowrank-jax launch, a pod, SLURM) it spans all of them")
    p.add_argument("--save-merged", default=_default("save_merged"), metavar="DIR",
                   help="also save the model with the adapters merged into its weights (a HF "
                        "folder that --model reads)")
    p.add_argument("--jobs", default=None, metavar="JOBS.yaml",
                   help="the same as `lowrank-jax jobs JOBS.yaml` (several LoRA jobs at once on "
                        "one base); the flags of one run are refused with it")
    # with --jobs every job's settings come from the file: these flags would be ignored
    p.set_defaults(func=run, jobs_ignores={dest: p.get_default(dest) for dest in _PER_RUN})


def run(args) -> int:
    if getattr(args, "jobs", None):
        return _run_jobs(args)
    fields = {name: getattr(args, name) for name in _JOB_FIELDS}
    FinetuneJob(**fields, progress=not args.no_progress).run(log=print)
    return 0


def _run_jobs(args) -> int:
    """``finetune --jobs JOBS.yaml``: ``lowrank-jax jobs JOBS.yaml``, refusing the flags of one
    run (they would be ignored)."""
    from lowrank_jax.train.job import device_mesh
    from lowrank_jax.train import run_jobs_file

    if device_mesh(args.mesh) is not None:  # joins the other processes first, as finetune does
        raise ValueError("--jobs trains packed jobs on one device; drop --mesh (or --jobs).")
    ignored = [f"--{dest.replace('_', '-')}" for dest, default in args.jobs_ignores.items()
               if getattr(args, dest) != default]
    if ignored:
        raise ValueError(
            f"--jobs takes every job's settings from {args.jobs}; {', '.join(ignored)} would "
            "be ignored. Put them in the file (per job: rank, alpha, lr, batch, data; for "
            "all jobs: targets, seq_len, steps, seed), or drop --jobs (it has no --quantize, "
            "--rank-plan or --save-merged).")
    run_jobs_file(args.jobs, model=args.model, out=args.out, overwrite=args.overwrite,
                  progress=not args.no_progress, log=print, argument="`jobs`")
    return 0
