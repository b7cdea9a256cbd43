"""``lowrank-jax export``: a model at a parameter budget from one SALAAD pretraining run.

Example::

    lowrank-jax pretrain --set structure=salaad --set model.projection=dense \\
        --set optimizer.name=adamw --set run_dir=runs/salaad
    lowrank-jax export --run runs/salaad --budget 0.5 --out runs/salaad-50
    lowrank-jax eval --model runs/salaad-50 --window 128

The folder loads with ``--model`` / :func:`lowrank_jax.hub.load_model` (its weights are
the dense surrogates ``L̃ + S̃``); ``salaad_factors.npz`` beside them holds the factored
+ sparse form the budget counts (see :func:`lowrank_jax.train.structure.export_salaad`).
"""

from __future__ import annotations

import argparse

from lowrank_jax.runs.validate import positive_float


def register(subparsers) -> None:
    """Add the ``export`` subcommand."""
    p = subparsers.add_parser(
        "export", help="a SALAAD model at a parameter budget from a structure=salaad run",
        description="Cut the low-rank + sparse surrogate of a `pretrain --set structure=salaad` "
                    "run to a fraction of its parameters (HPA allocation) and write a model "
                    "folder that eval / generate load.")
    p.add_argument("--run", dest="run_dir", required=True,
                   help="run_dir of the SALAAD pretraining run")
    p.add_argument("--budget", type=positive_float, required=True,
                   help="fraction of the dense parameter count in (0, 1], e.g. 0.5")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--gamma", type=float, default=0.5,
                   help="share of the reduction taken from the low-rank parts (default 0.5)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an output folder that is not empty")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lowrank_jax.runs.outputs import check_not_input
    from lowrank_jax.train.structure import export_salaad

    check_not_input(args.out, {"--run": args.run_dir})  # before the run is read: fails in a second
    report = export_salaad(args.run_dir, args.budget, args.out, gamma=args.gamma,
                           overwrite=args.overwrite)
    print(f"wrote {args.out}: {report['params']:,} of {report['dense_params']:,} parameters "
          f"({report['params'] / report['dense_params']:.1%}; budget {args.budget:g}) from step "
          f"{report['step']} of {args.run_dir}")
    return 0
