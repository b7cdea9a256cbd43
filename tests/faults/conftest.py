"""Fault-injection suite: shared helpers, the tiny shared run, and the reliability table.

Every test here injects one fault a user meets (a bad value, a full disk, a damaged
checkpoint, an occupied output folder, ...) and records what the command did through the
``faults`` fixture: ``clear error`` (exit 2, one line naming what was wrong), ``recovered``
(the work continued correctly), or a failure class (traceback, unclear error, silent result,
data lost). Every command's stderr is captured at the file-descriptor level (what a terminal
shows, C++ libraries included) and held to :data:`STDERR_BUDGET` lines, the clear line last.
At the end of the session the counts are printed as the table quoted in README.md
("Reliability"); ``LOWRANK_FAULTS_JSON=path`` also writes them as JSON.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib

import pytest

from lowrank_jax.cli import main as cli_main

# A pretraining run small enough to compile and run in seconds on a CPU.
TINY = [
    "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
    "model.d_ff=32", "model.max_seq_len=16", "model.projection=dense", "train.seq_len=16",
    "train.batch_size=4", "train.eval_batches=1", "train.eval_every=100", "train.log_every=1",
    "train.checkpoint_every=2", "train.steps=6", "optimizer.name=adamw",
    "optimizer.learning_rate=0.01",
]

_RESULTS: list[tuple[str, str, str]] = []  # (test, outcome, the command it tried)
API = "(library calls)"  # a case that calls the library, not a command
STDERR_BUDGET = 5  # lines a user sees after a fault (issue 40: recoveries printed thousands)
_STDERR_LINES: dict[str, int] = {}


def tree_digest(folder: pathlib.Path, *, skip: tuple[pathlib.Path, ...] = ()) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` outside ``skip``."""
    folder = pathlib.Path(folder)
    skip = tuple(pathlib.Path(s).resolve() for s in skip)
    out = {}
    for path in sorted(folder.rglob("*")):
        resolved = path.resolve()
        if any(resolved == s or s in resolved.parents for s in skip) or not path.is_file():
            continue
        out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Faults:
    """Runs the CLI in-process and classifies what happened."""

    def __init__(self, name, capfd, tmp_path):
        self.name, self.capsys, self.tmp_path = name, capfd, tmp_path
        self.outcome = None
        self.stderr_lines = 0
        self.command = None  # the first command the case runs: the one it tries

    def cli(self, argv, *, out=None):
        """Run ``lowrank-jax argv``; return ``(code, stdout, stderr)``. Files under
        ``tmp_path`` outside ``out`` must not change."""
        self.capsys.readouterr()
        if self.command is None and argv:
            self.command = str(argv[0])
        before = tree_digest(self.tmp_path, skip=(out,) if out else ())
        try:
            code = cli_main([str(a) for a in argv])
        except SystemExit as exit_:  # argparse
            code = exit_.code
        except BaseException as error:
            self.outcome = "traceback"
            raise AssertionError(f"{argv}: raised {type(error).__name__}: {error}") from error
        captured = self.capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        self.stderr_lines = max(self.stderr_lines, len(lines))
        if len(lines) > STDERR_BUDGET or (code not in (0, None) and lines
                                          and not lines[-1].startswith("lowrank-jax ")):
            self.outcome = "unclear error"
            raise AssertionError(f"{argv}: {len(lines)} stderr lines (budget {STDERR_BUDGET}, "
                                 f"the clear line last): {lines[:3]} ... {lines[-2:]}")
        after = tree_digest(self.tmp_path, skip=(out,) if out else ())
        if before != after:
            self.outcome = "data lost"
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            raise AssertionError(f"{argv}: files outside the output changed: {changed[:5]}")
        return code, captured.out, captured.err

    def expect_error(self, argv, message, *, out=None):
        """The command must exit 2 with exactly one stderr line containing ``message``."""
        code, _, err = self.cli(argv, out=out)
        lines = [line for line in err.strip().splitlines() if line.strip()]
        if "Traceback" in err:
            self.outcome = "traceback"
        elif code == 0:
            self.outcome = "silent result"
        elif code != 2 or len(lines) != 1 or message not in err:
            self.outcome = "unclear error"
        assert code == 2, (argv, code, err)
        assert len(lines) == 1, err
        assert message in lines[0], (message, err)
        self.outcome = "clear error"
        return lines[0]

    def recovered(self):
        self.outcome = "recovered"

    def clear_error(self):
        self.outcome = "clear error"


@pytest.fixture
def faults(request, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray relative write would land here and be noticed
    recorder = Faults(request.node.name, capfd, tmp_path)
    yield recorder
    _RESULTS.append((request.node.nodeid, recorder.outcome or "unclassified",
                     recorder.command or API))
    _STDERR_LINES[request.node.nodeid] = recorder.stderr_lines


@pytest.fixture(scope="session")
def tiny():
    """The ``--set`` overrides of the tiny pretraining run."""
    return list(TINY)


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory):
    """Two tiny pretraining runs, trained once for the whole suite: ``full`` (6 steps) and
    ``split`` (stopped after 4, checkpoints at steps 2 and 4, as after an interrupt)."""
    from lowrank_jax.train import load_config, train

    base = tmp_path_factory.mktemp("tiny_runs")
    quiet = {"progress": False, "log": lambda *_: None}
    full = train(load_config("tiny", TINY + [f"run_dir={base / 'full'}"]), **quiet)
    train(load_config("tiny", TINY + [f"run_dir={base / 'split'}"]), stop_after=4, **quiet)
    return {"full": base / "full", "split": base / "split", "full_result": full}


# the tiny run with the SALAAD structure (what `export` reads)
TINY_SALAAD = [*TINY, "structure=salaad", "salaad.rho=0.005", "salaad.kI_alpha=0.02",
               "salaad.every=2", "train.steps=4"]


@pytest.fixture(scope="session")
def tiny_salaad():
    """The ``--set`` overrides of the tiny SALAAD run (:func:`salaad_run`)."""
    return list(TINY_SALAAD)


@pytest.fixture(scope="session")
def salaad_run(tmp_path_factory):
    """A tiny ``structure=salaad`` pretraining run (4 steps, checkpoints at 2 and 4)."""
    from lowrank_jax.train import load_config, train

    run = tmp_path_factory.mktemp("salaad_run") / "run"
    train(load_config("tiny", TINY_SALAAD + [f"run_dir={run}"]), progress=False,
          log=lambda *_: None)
    return run


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    counts = collections.Counter(outcome for _, outcome, _ in _RESULTS)
    stats = terminalreporter.stats
    failed = {r.nodeid for r in stats.get("failed", []) + stats.get("error", [])}
    table = {
        "faults tried": len(_RESULTS),
        "clear errors": counts["clear error"],
        "recovered (work continued correctly)": counts["recovered"],
        "tracebacks": counts["traceback"],
        "unclear errors": counts["unclear error"],
        "silent results": counts["silent result"],
        "data lost": counts["data lost"],
        "other failures": sum(1 for node, _, _ in _RESULTS if node in failed)
        - counts["traceback"] - counts["unclear error"] - counts["silent result"]
        - counts["data lost"],
    }
    table[f"most stderr lines of a case (budget {STDERR_BUDGET})"] = max(
        _STDERR_LINES.values(), default=0)
    per_command: dict[str, collections.Counter] = {}
    for node, outcome, command in _RESULTS:
        per_command.setdefault(command, collections.Counter())[outcome] += 1
        if node in failed and outcome in ("clear error", "recovered"):
            per_command[command]["other failure"] += 1
    terminalreporter.write_sep("-", "reliability (tests/faults)")
    for key, value in table.items():
        terminalreporter.write_line(f"{key:<40}{value:>5}")
    terminalreporter.write_line(f"{'command':<18}{'cases':>6}{'clear':>6}{'recov':>6}"
                                f"{'unclr':>6}{'silent':>7}{'lost':>5}{'trace':>6}")
    for command, c in sorted(per_command.items()):
        terminalreporter.write_line(
            f"{command:<18}{sum(c.values()) - c['other failure']:>6}{c['clear error']:>6}"
            f"{c['recovered']:>6}{c['unclear error']:>6}{c['silent result']:>7}"
            f"{c['data lost']:>5}{c['traceback']:>6}")
    if os.environ.get("LOWRANK_FAULTS_JSON"):
        pathlib.Path(os.environ["LOWRANK_FAULTS_JSON"]).write_text(
            json.dumps({"table": table, "results": _RESULTS, "stderr_lines": _STDERR_LINES,
                        "per_command": {k: dict(v) for k, v in per_command.items()}},
                       indent=1))
