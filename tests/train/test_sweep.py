"""train.sweep: grids, EMA, steps to target, spikes and best-cell selection on hand-made values."""

import math

import numpy as np
import pytest

from lowrank_jax.train.sweep import (
    best_cell,
    count_within,
    ema,
    finite_or_inf,
    fit_power_law,
    isoflop_optimum,
    loss_spike,
    mean_std,
    parse_grid,
    steps_to_target,
)


def test_parse_grid_lists_and_logspace():
    assert parse_grid("0.1,2") == [0.1, 2.0]
    np.testing.assert_allclose(parse_grid("logspace:-3:-1:3"), [1e-3, 1e-2, 1e-1])
    with pytest.raises(ValueError, match="logspace:LOW_EXP"):
        parse_grid("logspace:-3:-1")


def test_ema_matches_the_recursion_and_keeps_nan():
    values = [4.0, 2.0, 1.0]
    np.testing.assert_allclose(ema(values, beta=0.9), [4.0, 3.8, 0.9 * 3.8 + 0.1])
    assert math.isnan(ema([1.0, float("nan"), 1.0])[-1])


def test_mean_std_of_the_finite_values():
    assert mean_std([2.0, 4.0, math.inf]) == (3.0, 1.0)
    assert all(math.isnan(v) for v in mean_std([None, float("nan")]))


def test_steps_to_target_of_an_ema_curve_and_spike():
    curve = list(enumerate(ema([5.0, 1.0, 1.0, 1.0], beta=0.5), start=1))  # 5, 3, 2, 1.5
    assert steps_to_target(curve, 2.0) == 3 and steps_to_target(curve, 1.0) is None
    # rise above the running minimum, counted from step 2 on: 3.5 - 1.0
    assert loss_spike([4.0, 1.0, 3.5, 0.5], after=2) == 2.5
    assert math.isnan(loss_spike([1.0], after=1))


def test_best_cell_skips_diverged_and_counts_near_cells():
    grid = np.array([[2.0, np.nan, 1.01], [1.0, np.inf, 1.5]])
    assert best_cell(grid) == (1, 0)
    assert count_within(grid, 1.0, 0.01) == 2 and count_within(grid, 1.0, 0.6) == 3
    assert finite_or_inf(float("nan")) == math.inf and finite_or_inf(2.0) == 2.0


def test_power_law_and_isoflop_fits():
    xs = [1e2, 1e3, 1e4, 1e5]
    a, c, err = fit_power_law(xs, [3.0 * x**0.5 for x in xs])
    np.testing.assert_allclose([a, np.exp(c), err], [0.5, 3.0, 0.0], atol=1e-9)
    assert math.isnan(fit_power_law([1.0, 2.0], [1.0, 4.0])[2])  # two points: no error bar
    sizes = np.exp([1.0, 2.0, 3.0])
    fit = isoflop_optimum(sizes, [1.0, 2.0, 1.5])  # opens downward: best measured size
    assert fit["n_opt"] == sizes[0] and not fit["vertex_inside_grid"]
    fit = isoflop_optimum(sizes, [3.0, 2.0, 1.5])  # vertex beyond the grid
    assert fit["quadratic"][0] > 0 and not fit["vertex_inside_grid"] and fit["min_loss"] == 1.5
