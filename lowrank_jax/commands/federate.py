"""``lowrank-jax federate``: federated LoRA simulations (FedHera, FedTreeLoRA, baselines)."""

from __future__ import annotations


from lowrank_jax.runs.validate import positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "federate", help="simulate federated LoRA (FedHera, FedTreeLoRA, baselines)",
        description="Simulate heterogeneous federated LoRA clients on real text (topic "
                    "classification of docstring sentences). Writes results.json, accuracy.png "
                    "and per-round checkpoints (a re-run resumes) to the run folder.",
    )
    p.add_argument("--config", default="configs/fed_hera.yaml",
                   help="YAML config (configs/fed_hera.yaml, configs/fed_tree.yaml)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds overriding the config")
    p.add_argument("--rounds", type=positive_int, default=None, help="override schedule.rounds")
    p.add_argument("--run-dir", default=None, help="override the config's run_dir")
    p.add_argument("--no-checkpoint", action="store_true", help="do not save / resume rounds")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    from lowrank_jax.federated import experiment

    overrides = {}
    if args.run_dir:
        overrides["run_dir"] = args.run_dir
    if args.no_checkpoint:
        overrides["checkpoint"] = False
    if args.seeds:
        try:
            overrides["seeds"] = [int(s) for s in args.seeds.split(",")]
        except ValueError as error:
            raise ValueError(f"--seeds {args.seeds!r}: give integers like 0,1,2.") from error
    import os

    from lowrank_jax.runs.validate import read_yaml_mapping

    if os.path.isfile(args.config):
        read_yaml_mapping(args.config, "--config")  # invalid YAML: one line with file and line
    config = experiment.load_experiment(args.config, overrides)
    from lowrank_jax.runs.outputs import check_not_input

    check_not_input(config.run_dir, {"--config": args.config}, argument="run_dir")
    if args.rounds is not None:
        if args.rounds < 1:
            raise ValueError(f"--rounds {args.rounds} must be >= 1.")
        config.schedule = {**config.schedule, "rounds": args.rounds}
    results = experiment.run_federated(config, progress=not args.no_progress)
    summary = experiment.summarize(results)
    path = experiment.save_results(results, summary, config)
    plot = f"{config.run_dir}/accuracy.png"
    experiment.plot_accuracy(results, plot, title=config.name)
    print(experiment.format_summary(summary))
    for name, s in summary.items():
        if "depths" in s:
            print(f"{name}: per-layer groups k_l (per seed) = {s['depths']}")
    print(f"wrote {path} and {plot}")
    return 0
