"""The benchmark suite: `lowrank-jax bench --quick` end to end, the one timer, record checks."""

import json
import re
import time

import pytest

from lowrank_jax.bench import BENCHMARKS, check_record, format_table, time_fn, time_interleaved
from lowrank_jax.cli import main


@pytest.mark.slow  # 90 s; test_only_runs_one_benchmark... runs one benchmark end to end
def test_quick_suite_runs_every_benchmark_and_writes_finite_ratios(tmp_path, capsys):
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    for key in ("date_utc", "jax", "flax", "optax", "backend", "cpu_count", "python"):
        assert record["machine"][key], key
    assert record["quick"] is True
    rows = record["rows"]
    assert {r["benchmark"] for r in rows} == set(BENCHMARKS)
    measured = [r for r in rows if "skipped" not in r]
    assert {r["benchmark"] for r in measured} == set(BENCHMARKS)  # quick needs no real model
    assert check_record(record) == []
    targets = 0
    for r in measured:
        assert r["time_ratio"] == pytest.approx(r["method_s"] / r["baseline_s"])
        if r.get("target") is not None:  # the verdict follows from the ratio and the target
            targets += 1
            op, threshold = re.match(r"(<=|<) ([0-9.]+)", r["target"]).groups()
            within = (r["time_ratio"] <= float(threshold) if op == "<="
                      else r["time_ratio"] < float(threshold))
            assert r["met"] is within, r
        else:
            assert r["met"] is None, r
    assert targets >= 2  # quick mode still judges some rows against their targets
    kinds = {r["case"].split()[0] for r in rows if r["benchmark"] == "factorized_vs_dense"}
    assert kinds == {"train_step", "prefill", "decode"}
    packed = [r for r in rows if r["benchmark"] == "packed_lora"][0]
    fractions = packed["breakdown_fraction"]
    assert set(fractions) == {"base", "optimizer", "host", "adapters"}
    assert all(v >= 0 for v in fractions.values())
    # the adapters' part is the rest of the packed step (0 when the parts already exceed it)
    assert sum(fractions.values()) == pytest.approx(1.0) or fractions["adapters"] == 0
    table = capsys.readouterr().out
    assert "method vs baseline" in table and "packed step time" in table
    assert len([line for line in table.splitlines() if line.startswith("factorized_vs_dense")]) == 3
    markdown = (tmp_path / "bench.md").read_text()
    assert markdown.count("| factorized_vs_dense |") == 3 and record["machine"]["jax"] in markdown


def test_only_runs_one_benchmark_and_rejects_unknown_names(tmp_path, capsys):
    assert main(["bench", "--quick", "--only", "load_time", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["benchmark"] for r in rows] == ["load_time"]
    assert rows[0]["time_ratio"] > 1  # building a model costs more than reading its bytes
    assert main(["bench", "--only", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "--only nope: unknown benchmark" in capsys.readouterr().err


def test_time_interleaved_ranks_known_durations():
    def sleeper(seconds):
        return lambda: time.sleep(seconds)

    times = time_interleaved({"short": sleeper(0.01), "long": sleeper(0.03)}, reps=3, warmup=0)
    assert times["long"] / times["short"] > 1.5
    assert time_fn(lambda: time.sleep(0.01), reps=2, warmup=0) >= 0.009
    with pytest.raises(ValueError, match="reps=0 must be a positive int"):
        time_interleaved({"a": lambda: None}, reps=0)


def test_check_record_and_table_report_bad_and_skipped_rows():
    good = {"benchmark": "b", "case": "c", "method": "m", "baseline": "base", "method_s": 0.5,
            "baseline_s": 1.0, "time_ratio": 0.5, "target": "<= 0.5", "met": True}
    record = {"rows": [good, {"benchmark": "b", "case": "d", "skipped": "no torch"},
                       dict(good, case="e", time_ratio=float("nan")),
                       {"benchmark": "b", "case": "f", "error": "ValueError: x"}]}
    problems = check_record(record)
    assert len(problems) == 2 and "time_ratio=nan" in problems[0] and "ValueError" in problems[1]
    table = format_table(record)
    assert "SKIPPED: no torch" in table and "2.00" in table and "MET" in table
