"""analysis.report plots: curves and sweep heatmaps write a PNG of the expected layout."""

import matplotlib.image
import numpy as np
import pytest

from lowrank_jax.analysis.report import plot_panels, plot_grid_heatmaps


def test_plot_curves_panels_bands_and_log_axes(tmp_path):
    path = tmp_path / "curves.png"
    plot_panels([{"curves": [{"y": [3.0, 2.0, 1.0], "band": ([2.5, 1.5, 0.5], [3.5, 2.5, 1.5]),
                              "label": "a"},
                             {"x": [1, 2, 4], "y": [1.0, 2.0, 3.0], "style": "o",
                              "annotate": ["p", "q", "r"]}],
                  "hlines": [(1.5, None, ":")], "vlines": [(2, "x=2", "--")], "xscale": "log2",
                  "ylim": (0, 4)},
                 {"curves": [{"y": [1e-3, 1e-1]}], "yscale": "log", "legend": False,
                  "grid": True}], str(path), suptitle="two panels", figsize=(6, 3), dpi=50)
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (300, 150)


def test_plot_grid_heatmaps_accepts_diverged_cells(tmp_path):
    path = tmp_path / "grid.png"
    grids = {"a": np.array([[1.0, np.nan], [2.0, 1.005]]), "b": np.array([[np.inf, 3.0],
                                                                          [2.0, 2.0]])}
    plot_grid_heatmaps(grids, str(path), xticks=["1e-3", "1e-2"], yticks=["1", "10"],
                       xlabel="lr", ylabel="scale", colorbar="loss", vmax=2.5)
    assert matplotlib.image.imread(path).shape[0] > 100
    with pytest.raises(ValueError):
        plot_grid_heatmaps({"a": np.full((2, 2), np.nan)}, str(path), xticks=["x", "y"],
                           yticks=["u", "v"], xlabel="", ylabel="", colorbar="")


def test_plot_bars_writes_the_figure_size(tmp_path):
    from lowrank_jax.analysis.report import plot_bars

    path = tmp_path / "sub" / "bars.png"
    plot_bars(["fp32", "RTN-2"], [12.0, 340.0], path, ylabel="ppl", yscale="log",
              figsize=(4, 2), dpi=50)
    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (200, 100)
