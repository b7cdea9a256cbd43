"""kv.evaluate.parse_setting / summarize_sweep on hand-made per-window records."""

import math

import numpy as np
import pytest

from lowrank_jax.kv.evaluate import parse_setting, summarize_sweep


def test_parse_setting_casts_values():
    assert parse_setting("kivi:4") == {"method": "kivi", "ratio": 4.0}
    assert parse_setting("xkv:2:group=4,scale=0.5,flag=False,name=a") == {
        "method": "xkv", "ratio": 2.0, "group": 4, "scale": 0.5, "flag": False, "name": "a"}


def test_summarize_sweep_rows_against_the_exact_cache():
    def rec(label, ratio, window, nll, ratio_reached=None):
        return dict(label=label, target_ratio=ratio, window=window, nll=nll,
                    perplexity=math.exp(nll), compression_ratio=ratio_reached or 1.0,
                    key_error=0.1 * window, value_error=0.2, ranks=[3])

    records = [rec("exact", None, 0, 1.0), rec("exact", None, 1, 2.0),
               rec("xkv", 4.0, 0, 1.2, 4.1), rec("xkv", 4.0, 1, 2.2, 3.9),
               rec("late", 2.0, 1, 2.1, 2.0),  # an interrupted row: window 1 only
               dict(label="kivi", target_ratio=8.0, window=0, method="kivi",
                    unreachable="cannot reach 8x")]
    labelled = [("exact", dict(method="none", ratio=None)), ("xkv", dict(method="xkv", ratio=4.0)),
                ("late", dict(method="xkv", ratio=2.0)), ("kivi", dict(method="kivi", ratio=8.0))]
    exact, xkv, late, kivi = summarize_sweep(labelled, records)
    assert exact["perplexity"] == pytest.approx(math.exp(1.5)) and exact["vs_exact"] == 0.0
    assert xkv["actual"] == 3.9 and xkv["key_error"] == pytest.approx(0.05)
    assert xkv["vs_exact"] == pytest.approx(math.exp(0.2) - 1)
    np.testing.assert_allclose(xkv["windows"], [math.exp(1.2), math.exp(2.2)])
    assert late["vs_exact"] == pytest.approx(math.exp(0.1) - 1)  # same window of the exact row
    assert kivi == dict(label="kivi", method="kivi", target=8.0, unreachable="cannot reach 8x")


def test_grid_rows_tables_and_plots(tmp_path, saved_figures):
    from lowrank_jax.kv.report import (
        plot_grid,
        plot_sweep,
        record_line,
        summarize_grid,
        sweep_table,
    )

    def rec(method, ratio, sink, group, nll, reached):
        return dict(method=method, target_ratio=ratio, sink_tokens=sink, group_size=group,
                    nll=nll, perplexity=math.exp(nll), compression_ratio=reached, rank_k=2,
                    rank_v=1, key_error=0.1, value_error=0.3)

    records = [rec("none", None, None, None, 1.0, 1.0), rec("none", None, None, None, 2.0, 1.0),
               rec("xkv", 4.0, 0, 4, 1.5, 4.2), rec("xkv", 4.0, 0, 4, 2.5, 3.8),
               rec("xkv", 4.0, 16, 4, 9.0, 9.0)]  # another sink setting: not in the first row
    exact, xkv = summarize_grid([("none", None, 0, 1), ("xkv", 4.0, 0, 4)], records)
    assert exact["perplexity"] == pytest.approx(math.exp(1.5))
    assert xkv["perplexity"] == pytest.approx(math.exp(2.0))
    assert xkv["compression_ratio"] == pytest.approx(4.0)
    assert xkv["window_perplexities"] == [math.exp(1.5), math.exp(2.5)]
    plot_grid([exact, xkv], str(tmp_path / "grid.png"))
    row = dict(label="xKV", method="xkv", target=4.0, actual=3.95, perplexity=10.0,
               vs_exact=0.05, key_error=0.1, value_error=0.2, windows=[9.0, 11.0])
    far = dict(label="KIVI", method="kivi", target=16.0, unreachable="no")
    assert sweep_table([row, far])[2:] == [
        "| xKV | 4× | 3.95× | 10.00 | +5.0 % | 0.100 | 0.200 | 9.00 / 11.00 |",
        "| KIVI | 16× | unreachable | – | – | – | – | – |"]
    assert record_line("xKV", dict(rec("xkv", 4.0, 0, 4, 0.0, 4.2), window=1)) == (
        "  w1 xKV @ 4.0: 4.20x ppl 1.000 K 0.100 V 0.300 ranks 2/1")
    plot_sweep([dict(row, method="none", label="exact"), row, far], str(tmp_path / "sweep.png"))
    grid, sweep = (saved_figures[str(tmp_path / name)] for name in ("grid.png", "sweep.png"))
    assert grid.ink() > 0.02 and sweep.ink() > 0.02
    # the grid: xKV's (ratio, perplexity) point (the paper's setting, no sink), the exact line
    assert grid.lines() == [("xkv (G=4), paper", [4.0], [pytest.approx(math.exp(2.0))]),
                            ("exact cache", [0.0, 1.0], [pytest.approx(math.exp(1.5))] * 2)]
    # the sweep: the reached ratios (KIVI's unreachable target draws nothing) and +3 % / +10 %
    assert sweep.lines() == [("xKV", [3.95], [10.0]),
                             ("exact cache (fp16)", [0.0, 1.0], [10.0, 10.0]),
                             ("exact +3 %", [0.0, 1.0], [pytest.approx(10.3)] * 2),
                             ("exact +10 %", [0.0, 1.0], [pytest.approx(11.0)] * 2)]
