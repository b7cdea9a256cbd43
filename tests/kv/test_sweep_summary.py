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
