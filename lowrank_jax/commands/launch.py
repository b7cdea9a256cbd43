"""``lowrank-jax launch``: run another lowrank-jax command as several JAX processes on this machine.

``lowrank-jax launch --processes 2 --devices-per-process 4 -- pretrain --mesh data=2,fsdp=4``
starts two processes of four CPU devices each (a localhost coordinator, gloo collectives), the
way a TPU pod slice or a GPU cluster runs one process per host. See
:func:`lowrank_jax.train.multihost.launch`.
"""

from __future__ import annotations

import sys

from lowrank_jax.runs.validate import positive_float, positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run a command as several local JAX processes (multi-host test bed)",
        description="Run a lowrank-jax command (pretrain, ...) as N JAX processes on this "
                    "machine, each with its own simulated CPU devices, joined by a coordinator "
                    "on a free localhost port. Output lines carry a [p0]/[p1] prefix; when one "
                    "process fails, all are stopped within seconds.",
    )
    p.add_argument("--processes", type=positive_int, default=2, help="number of processes")
    p.add_argument("--devices-per-process", type=positive_int, default=4,
                   help="CPU devices each process simulates")
    p.add_argument("--stop-timeout", type=positive_float, default=5.0, metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL when stopping the processes")
    p.add_argument("rest", nargs="*", metavar="-- COMMAND ARGS",
                   help="the lowrank-jax command every process runs, after --")
    p.set_defaults(func=run)


def run(args) -> int:
    import pkgutil

    from lowrank_jax import commands
    from lowrank_jax.train.multihost import launch

    rest = list(args.rest)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise ValueError("launch: no command given; put it after --, e.g. lowrank-jax launch "
                         "--processes 2 -- pretrain --mesh data=2,fsdp=4.")
    if rest[0] == "launch":
        raise ValueError("launch: the command to run cannot be launch itself.")
    names = sorted(m.name for m in pkgutil.iter_modules(commands.__path__)
                   if not m.name.startswith("_") and m.name != "launch")
    if rest[0] not in names:
        raise ValueError(f"launch: {rest[0]!r} is not a lowrank-jax command; put one of "
                         f"{', '.join(names)} after --.")
    status, why = launch([sys.executable, "-m", "lowrank_jax.cli", *rest],
                         processes=args.processes, devices_per_process=args.devices_per_process,
                         stop_timeout=args.stop_timeout)
    if status:
        print(f"lowrank-jax launch: error: {why}", file=sys.stderr)
    return status
