"""``lowrank-jax jobs JOBS.yaml``: several LoRA jobs trained at once on one base (PLoRA packing).

Parses arguments and calls :func:`lowrank_jax.train.jobs.run_jobs_file`; every job's settings
(rank, alpha, lr, batch, data; targets, seq_len, steps, seed for all) come from the file, so the
command takes only the flags that apply to all of them. Each job's adapter is saved in
HuggingFace PEFT format to ``OUT/<name>/adapter``.
"""

from __future__ import annotations

from lowrank_jax.commands._common import library_default
from lowrank_jax.train import run_jobs_file


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "jobs", help="train several LoRA jobs at once on one base (PLoRA packing), PEFT export",
        description="Train the LoRA jobs of a YAML file at once on one frozen base and save one "
                    "PEFT adapter per job. Every job's settings come from the file; see "
                    "lowrank_jax/train/jobs.py for its format.",
    )
    p.add_argument("jobs", metavar="JOBS.yaml", help="the jobs file")
    p.add_argument("--model", default=library_default(run_jobs_file, "model"),
                   help="the base when the file names none: 'tiny', 'smollm2', a .gguf file or "
                        "a model folder")
    p.add_argument("--out", default=library_default(run_jobs_file, "out"),
                   help="output folder when the file names none (OUT/<job>/adapter, "
                        "jobs_summary.json)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty or holds another run")
    p.set_defaults(func=run)


def run(args) -> int:
    run_jobs_file(args.jobs, model=args.model, out=args.out, overwrite=args.overwrite,
                  progress=not args.no_progress, log=print)
    return 0
