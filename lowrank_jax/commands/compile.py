"""``lowrank-jax compile``: compile a config's pretraining step for a TPU pod on this host."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compile", help="compile the pretraining step for a TPU pod or GPU node, on any host",
        description="Build pretrain's sharded train step for a TPU topology or a GPU node "
                    "(abstract state and batch, the config's mesh over the topology's devices), "
                    "compile it on this host (libtpu, or XLA's GPU compiler) and print the "
                    "per-device memory against the chip's HBM and the step's FLOPs. Exit "
                    "status 2 when it does not fit.")
    p.add_argument("--config", default="tpu_v5e_256", help="a preset name or a YAML file")
    p.add_argument("--topology", default=None,
                   help="a TPU slice (v5e-8, v5e-256, v5p-128, v6e-64, ...), a libtpu "
                        "topology (v5e:2x4, v5p:2x2x2, v6e:4x4) or GPUs (8xh200, 16xh100: "
                        "needs the CUDA plugin, not a GPU); default: the config's topology")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=run)


def run(args) -> int:
    from pallas_kernels.aot import TopologyError

    from lowrank_jax.train.aot_step import DoesNotFit, compile_pretrain_step, native_stderr
    from lowrank_jax.train import load_config

    try:
        with native_stderr(show=args.debug):  # libtpu's / the CUDA plugin's start-up lines
            cfg = load_config(args.config, args.overrides)
            topology = args.topology or cfg.topology
            if topology is None:
                raise ValueError(f"--topology is needed: config {args.config!r} names none "
                                 "(e.g. --topology v5e-8, or topology: v5e-8 in the config).")
            report = compile_pretrain_step(cfg, topology, config=args.config)
    except (TopologyError, DoesNotFit) as error:
        print(f"lowrank-jax compile: error: {error}", file=sys.stderr)
        return 2
    print(report.table())
    return 0 if report.fits else 2
