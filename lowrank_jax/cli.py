"""The ``lowrank-jax`` command: one subcommand per module in ``lowrank_jax/commands/``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import lowrank_jax
from lowrank_jax import commands

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, FloatingPointError, KeyError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowrank-jax",
        description="Low-rank methods for LLMs in JAX: pretrain, fine-tune, edit, compress.",
    )
    parser.add_argument("--version", action="version", version=lowrank_jax.__version__)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"lowrank_jax.commands.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"lowrank-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        if args.debug:
            raise
        message = error.args[0] if error.args else str(error)
        print(f"lowrank-jax {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
