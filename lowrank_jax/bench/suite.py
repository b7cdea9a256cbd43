"""One benchmark suite: every efficiency claim as a ratio to its baseline, measured in one process.

Each benchmark in :data:`BENCHMARKS` is ``fn(*, quick, reps) -> list[dict]``; a row holds
``benchmark, case, method, baseline, method_s, baseline_s, time_ratio`` (``method_s /
baseline_s``: below 1 the method is faster), an optional ``target`` with ``met``, or ``skipped``
with the reason. :func:`run_suite` runs them, :func:`format_table` prints one table, and the
record written by ``lowrank-jax bench`` adds :func:`~lowrank_jax.bench.timing.machine_record`.

Example::

    >>> sorted(BENCHMARKS)[:2]
    ['factorized_vs_dense', 'load_time']
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Callable, Sequence

from lowrank_jax.bench.packed import packed_lora
from lowrank_jax.bench.serving import load_time, smollm2_serving
from lowrank_jax.bench.timing import machine_record
from lowrank_jax.bench.training import factorized_vs_dense, spectron_overhead

#: The benchmark suite: name -> function returning its result rows (``lowrank-jax bench``).
BENCHMARKS: dict[str, Callable[..., list[dict]]] = {
    "spectron_overhead": spectron_overhead,
    "factorized_vs_dense": factorized_vs_dense,
    "packed_lora": packed_lora,
    "smollm2_serving": smollm2_serving,
    "load_time": load_time,
}


def select_benchmarks(only: Sequence[str] | None) -> list[str]:
    """The benchmark names to run (all by default); unknown names raise ``ValueError``."""
    if not only:
        return list(BENCHMARKS)
    unknown = [name for name in only if name not in BENCHMARKS]
    if unknown:
        raise ValueError(f"only={', '.join(unknown)}: unknown benchmark; choose from "
                         f"{', '.join(BENCHMARKS)}.")
    return list(dict.fromkeys(only))


def run_suite(*, quick: bool = False, only: Sequence[str] | None = None, reps: int | None = None,
              log: Callable[[str], None] = print) -> dict:
    """Run the selected benchmarks; returns ``{"machine", "quick", "reps", "rows", "seconds"}``.

    A benchmark that raises is recorded as a row with ``error`` (the others still run).
    """
    names = select_benchmarks(only)
    reps = reps or (2 if quick else 7)
    record = {"machine": machine_record(), "quick": quick, "reps": reps, "rows": [],
              "seconds": {}}
    for name in names:
        start = time.perf_counter()
        try:
            rows = BENCHMARKS[name](quick=quick, reps=reps)
        except Exception as err:  # noqa: BLE001 - one broken benchmark must not stop the rest
            rows = [{"benchmark": name, "case": "all", "error": f"{type(err).__name__}: {err}",
                     "traceback": traceback.format_exc()[-3000:]}]
        record["rows"].extend(rows)
        record["seconds"][name] = round(time.perf_counter() - start, 2)
        log(f"[bench] {name}: {len(rows)} rows in {record['seconds'][name]} s")
    return record


def _fmt(x: float) -> str:
    return f"{x * 1e3:.3g}ms" if x < 1 else f"{x:.3g}s"


def format_table(record: dict) -> str:
    """One table: benchmark, case, method vs baseline, time ratio, speedup, target, met."""
    head = (f"{'benchmark':20s} {'case':44s} {'method vs baseline':44s} {'ratio':>7s} "
            f"{'speedup':>7s}  target")
    lines = [head, "-" * len(head)]
    for r in record["rows"]:
        if "time_ratio" not in r:
            why = r.get("skipped") or r.get("error", "")
            label = "SKIPPED" if "skipped" in r else "ERROR"
            lines.append(f"{r['benchmark']:20s} {r.get('case', ''):44s} {label}: {why}")
            continue
        versus = f"{r['method']} {_fmt(r['method_s'])} vs {r['baseline']} {_fmt(r['baseline_s'])}"
        target = "" if r.get("target") is None else (
            f"{r['target']} {'MET' if r.get('met') else 'NOT MET'}")
        lines.append(f"{r['benchmark']:20s} {r['case']:44s} {versus:44s} "
                     f"{r['time_ratio']:7.3f} {1 / r['time_ratio']:7.2f}  {target}")
        if "breakdown_fraction" in r:
            parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["breakdown_fraction"].items())
            lines.append(f"{'':20s} {'  packed step time:':44s} {parts}")
        if "step_ratio_from_update_times" in r:
            lines.append(f"{'':20s} {'  from update times (step + extra update):':44s} "
                         f"{r['step_ratio_from_update_times']:.4f}")
    return "\n".join(lines)


def _load(load) -> str:
    return "unknown" if not load else " / ".join(f"{x:.1f}" for x in load)


def format_markdown(record: dict) -> str:
    """The table as Markdown (for ``docs/results/bench.md``), with the machine line above it."""
    m = record["machine"]
    lines = [f"Run {m['date_utc']} UTC on {m['host']} ({m['backend']}, {m['cpu_count']} CPUs, "
             f"load average {_load(m['load_average'])}), jax {m['jax']}, flax {m['flax']}, optax "
             f"{m['optax']}; {record['reps']} interleaved rounds per measurement, medians.", "",
             "| benchmark | case | method | baseline | method / baseline time | speedup | "
             "target |", "|---|---|---|---|---:|---:|---|"]
    for r in record["rows"]:
        if "time_ratio" not in r:
            why = r.get("skipped") or r.get("error", "")
            lines.append(f"| {r['benchmark']} | {r.get('case', '')} | skipped: {why} | | | | |")
            continue
        target = "" if r.get("target") is None else (
            f"{r['target']}: {'met' if r.get('met') else '**not met**'}")
        lines.append(f"| {r['benchmark']} | {r['case']} | {r['method']} | {r['baseline']} | "
                     f"{r['time_ratio']:.3f} | {1 / r['time_ratio']:.2f}x | {target} |")
        if "breakdown_fraction" in r:
            parts = ", ".join(f"{k} {100 * v:.0f} %" for k, v in r["breakdown_fraction"].items())
            lines.append(f"| | packed step time split | {parts} | | | | |")
        if "step_ratio_from_update_times" in r:
            lines.append(f"| | same, from update times: (AdamW step + extra update time) / "
                         f"AdamW step | | | {r['step_ratio_from_update_times']:.4f} | | |")
    return "\n".join(lines) + "\n"


def check_record(record: dict) -> list[str]:
    """Problems with a record's structure (empty list: fine): every row names its benchmark and
    case, and has a finite positive ratio or says why it was skipped."""
    problems = []
    for r in record.get("rows", []):
        if "benchmark" not in r or "case" not in r:
            problems.append(f"row without benchmark/case: {r}")
        elif "error" in r:
            problems.append(f"{r['benchmark']} {r['case']}: {r['error']}")
        elif "skipped" not in r:
            ratio = r.get("time_ratio")
            if not (isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0):
                problems.append(f"{r['benchmark']} {r['case']}: time_ratio={ratio!r}")
    return problems


__all__ = ["BENCHMARKS", "check_record", "format_markdown", "format_table", "run_suite",
           "select_benchmarks"]
