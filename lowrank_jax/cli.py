"""The ``lowrank-jax`` command: one subcommand per module in ``lowrank_jax/commands/``.

One error boundary: every user mistake (a bad config key or value, a file that is missing, not
UTF-8 or not writable, a full disk, malformed YAML, a bad regex) exits with status 2 and one
line ``lowrank-jax <command>: error: ...`` naming the argument / file / key, what was wrong and
how to fix it. The library's messages name its parameters (a leading ``batch_size=0:``, a
name in backquotes in the text); printed here they name the command's flags instead
(``--batch-size 0:``, ``--lr``; :func:`as_flags`). Anything else is a bug: one line asking for
``--debug``, status 1. ``--debug`` shows the full traceback in both cases. A run stopped by
SIGTERM at a step boundary (checkpoint and summary written, :mod:`lowrank_jax.runs.signals`)
exits 143; Ctrl-C exits 130. An output folder the failed command created and left empty is
removed; run locks are released.

The libraries' own detail (orbax / TensorStore / absl / asyncio log records, Python warnings,
``Exception ignored in ...`` at shutdown) goes to the run folder's ``lowrank-jax.log``, not to
the terminal (:mod:`lowrank_jax.runs.quiet`; ``--debug`` shows it), and every checkpoint manager
is closed before the command returns, so the one clear line is the last line of stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import pkgutil
import re
import sys

import lowrank_jax
from lowrank_jax import commands

USER_ERRORS = (ValueError, OSError, FloatingPointError, KeyError, re.error)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage itself is in ``--help``)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lowrank-jax",
        description="Low-rank methods for LLMs in JAX: pretrain, fine-tune, edit, compress.",
    )
    parser.add_argument("--version", action="version", version=lowrank_jax.__version__)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"lowrank_jax.commands.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def describe_error(error: BaseException) -> str:
    """The one-line message of a user error (the first line of it, never a traceback)."""
    from lowrank_jax.runs.outputs import describe_os_error

    if isinstance(error, UnicodeDecodeError):
        return (f"input is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                f"{error.start}); convert the file to UTF-8.")
    if isinstance(error, re.error):
        return (f"invalid regular expression {error.pattern!r} ({error.msg}); escape special "
                "characters with a backslash.")
    if isinstance(error, OSError):
        message = describe_os_error(error)
    elif isinstance(error, KeyError):
        message = f"missing key {error.args[0]!r}" if error.args else "missing key"
    else:
        message = str(error.args[0]) if error.args else type(error).__name__
    lines = [line for line in str(message).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


_PARAMETER = re.compile(r"`([a-z][a-z0-9_]*)`|^([a-z][a-z0-9_]*)=|`([a-z][a-z0-9_.]*=[^`]*)`")


def command_flags(parser: argparse.ArgumentParser, command: str | None) -> dict[str, str]:
    """``{dest: --flag}`` of the options of subcommand ``command`` of ``parser``."""
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
                  None)
    sub = action.choices.get(command) if action is not None and command else None
    if sub is None:
        return {}
    return {a.dest: max(a.option_strings, key=len) for a in sub._actions
            if a.option_strings and a.option_strings[0].startswith("--")}


def as_flags(message: str, flags: dict[str, str]) -> str:
    """A library message as the command line says it: each name in backquotes and a
    leading ``name=value`` that name a parameter the command has a flag for become that flag
    (``--name`` and ``--name value``); a backquoted config override (`` `train.seed=0` ``, the
    string :func:`lowrank_jax.train.load_config` takes) becomes ``--set train.seed=0`` where
    the command has ``--set``; other text is left as it is.

    Example::

        >>> as_flags("batch_size=0: must be a positive integer; lower `lr`.",
        ...          {"batch_size": "--batch-size", "lr": "--lr"})
        '--batch-size 0: must be a positive integer; lower --lr.'
        >>> as_flags("give a seed, e.g. `train.seed=0`.", {"overrides": "--set"})
        'give a seed, e.g. --set train.seed=0.'
    """
    def flag(match: re.Match) -> str:
        quoted, leading, override = match.group(1), match.group(2), match.group(3)
        if override is not None:
            return f"{flags['overrides']} {override}" if "overrides" in flags else match.group(0)
        name = quoted or leading
        if name not in flags:
            return match.group(0)
        return flags[name] if quoted else f"{flags[name]} "

    return _PARAMETER.sub(flag, message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's parser: "lowrank-jax jobs: error: ..."
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (action.choices.get(args.command) or parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from lowrank_jax.runs.quiet import quiet_libraries

    # called as the program (argv None): the hooks stay for the interpreter's shutdown
    quiet = (contextlib.nullcontext() if args.debug
             else quiet_libraries(keep_after=argv is None))
    with quiet:
        return _run(args, command_flags(parser, args.command))


def _close_checkpoints() -> None:
    checkpoint = sys.modules.get("lowrank_jax.io.checkpoint")  # imported only if used
    if checkpoint is not None:
        checkpoint.close_managers()


def _run(args, flags: dict[str, str] | None = None) -> int:
    from lowrank_jax.runs import lock, outputs, signals

    def described(error: BaseException) -> str:
        return as_flags(describe_error(error), flags or {})

    outputs.forget_created()
    try:
        try:
            code = int(args.func(args) or 0)
            outputs.forget_created()  # what the command made is its output
            return code
        finally:
            _close_checkpoints()  # before the message: nothing of orbax's comes after it
            lock.release_all()
    except signals.Stopped as stopped:
        outputs.forget_created()
        print(f"lowrank-jax {args.command}: {described(stopped)}", file=sys.stderr)
        return signals.EXIT_STOPPED
    except KeyboardInterrupt:
        print(f"lowrank-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        outputs.discard_unused()
        if args.debug:
            raise
        print(f"lowrank-jax {args.command}: error: {described(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # a bug: one line, the traceback on --debug
        outputs.discard_unused()
        if args.debug:
            raise
        io_error = outputs.os_error_of(error)  # a full disk in a library that says so in text
        if io_error is not None:
            print(f"lowrank-jax {args.command}: error: {described(io_error)}",
                  file=sys.stderr)
            return 2
        print(f"lowrank-jax {args.command}: internal error ({type(error).__name__}: "
              f"{described(error)}); rerun with --debug for the traceback and report it.",
              file=sys.stderr)
        return 1


def captured(argv: list[str]) -> tuple[int, str]:
    """``(exit status, stdout)`` of ``lowrank-jax ARGV`` run in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue().strip()


def save_and_check(model, folder: str, *, n_params: int, tokenizer=None, report=None,
                   prompt: str = "What is the capital of France?", max_new_tokens: int = 24,
                   eval_tokens: int | None = None) -> dict:
    """Save ``model`` (:func:`lowrank_jax.hub.save_model`), weigh the folder against fp16, and
    use it through the commands a user runs on it.

    With a tokenizer, ``lowrank-jax generate --model FOLDER --prompt PROMPT`` answers the prompt
    and (``eval_tokens``) ``lowrank-jax eval --model FOLDER`` scores ``eval_tokens`` tokens in
    disjoint 256-token windows; each command's output is printed and returned.

    Args:
        model: the model to save (dense, LoRA or quantized).
        folder: where to write it.
        n_params: parameters of the dense model (its fp16 size is ``2 · n_params`` bytes).
        tokenizer, report: written into the folder (``report``: the quantization report).
        prompt, max_new_tokens: the ``generate`` check.
        eval_tokens: tokens of the ``eval`` check (``None``: no eval).

    Returns:
        ``{"path", "folder_mib", "fp16_mib", "folder_vs_fp16", "question", "answer"}`` (the
        answer ``None`` without a tokenizer) and ``"cli_eval"`` when evaluated.
    """
    import os

    from lowrank_jax.hub import save_model

    save_model(model, folder, tokenizer=tokenizer, report=report)
    on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                  if os.path.isfile(os.path.join(folder, f)))
    measured = {"path": folder, "folder_mib": on_disk / 2**20, "fp16_mib": n_params * 2 / 2**20,
                "folder_vs_fp16": on_disk / (n_params * 2), "question": prompt, "answer": None}
    if tokenizer is None:  # nothing to chat with
        return measured
    code, measured["answer"] = captured(["generate", "--model", folder, "--prompt", prompt,
                                         "--max-new-tokens", str(max_new_tokens)])
    print(f"lowrank-jax generate --model {folder} --prompt {prompt!r} (exit {code}): "
          f"{measured['answer']}")
    if eval_tokens:
        code, measured["cli_eval"] = captured([
            "eval", "--model", folder, "--window", "257", "--stride", "256", "--max-tokens",
            str(eval_tokens + 1), "--no-progress"])
        print(f"lowrank-jax eval --model {folder} (exit {code}): {measured['cli_eval']}")
    return measured


if __name__ == "__main__":
    sys.exit(main())
