"""Benchmarks of the library's efficiency claims, each as a ratio to its same-run baseline.

``lowrank-jax bench [--quick] [--only NAME]`` runs :func:`run_suite`; the one timer of the
project is :func:`time_fn` / :func:`time_interleaved` / :func:`time_once` (the device check and
the scripts in ``scripts/bench`` use it too).
"""

from lowrank_jax.bench.suite import (
    BENCHMARKS,
    check_record,
    format_markdown,
    format_table,
    run_suite,
    select_benchmarks,
)
from lowrank_jax.bench.timing import (
    cpu_usage,
    decode_rates,
    interleaved_samples,
    machine_record,
    reference_matmul_seconds,
    speedup,
    time_compiled,
    time_fn,
    time_interleaved,
    time_once,
)

__all__ = ["BENCHMARKS", "check_record", "cpu_usage", "decode_rates", "format_markdown",
           "format_table", "interleaved_samples", "machine_record", "reference_matmul_seconds",
           "run_suite", "select_benchmarks", "speedup", "time_compiled", "time_fn",
           "time_interleaved", "time_once"]
