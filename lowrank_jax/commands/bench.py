"""``lowrank-jax bench``: the benchmark suite (every claim as a same-run ratio), table + JSON."""

from __future__ import annotations


def register(subparsers) -> None:
    from lowrank_jax.runs.validate import positive_int

    p = subparsers.add_parser(
        "bench", help="benchmark suite: method vs baseline time ratios, one table + JSON",
        description="Measure every efficiency claim against its baseline in one process "
                    "(round-robin, medians) and print one table of time ratios.")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; a smoke test)")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="run only this benchmark (repeatable): spectron_overhead, "
                        "factorized_vs_dense, packed_lora, smollm2_serving, load_time")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="timed rounds per measurement (default 2 quick, 7 full)")
    p.add_argument("--out", default="runs/bench",
                   help="folder for bench.json and bench.md (the table)")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from lowrank_jax.bench import (
        check_record,
        format_markdown,
        format_table,
        run_suite,
        select_benchmarks,
    )
    from lowrank_jax.runs import atomic_write_text, prepare_output

    select_benchmarks(args.only)  # a bad name fails before any work
    # resume=True: a folder of an earlier bench run is reused (bench.json replaced)
    out = prepare_output(args.out, command="bench", resume=True)
    record = run_suite(quick=args.quick, only=args.only, reps=args.reps)
    print(format_table(record))
    path = out / "bench.json"
    atomic_write_text(path, json.dumps(record, indent=1, default=str))
    atomic_write_text(out / "bench.md", format_markdown(record))
    print(f"wrote {path} and {out / 'bench.md'}")
    problems = check_record(record)
    for problem in problems:
        print(f"problem: {problem}")
    return 1 if problems else 0
