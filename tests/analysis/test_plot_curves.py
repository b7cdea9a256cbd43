"""The shared curve plot draws the given curves and reference line into a PNG."""

import pytest

from lowrank_jax.analysis.report import plot_curves


def test_plot_curves_draws_each_curve_and_the_reference_line(tmp_path, saved_figures):
    path = tmp_path / "img" / "curves.png"
    plot_curves([{"x": [0, 1], "y": [2.0, 1.0], "label": "a"}, {"x": [0, 1], "y": [2.0, 1.5]}],
                path, xlabel="step", ylabel="loss", hline=(1.2, "target"), yscale="log")
    assert path.read_bytes()[:4] == b"\x89PNG"
    saved = saved_figures[str(path)]
    (ax,) = saved.figure.axes
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale()) == ("step", "loss", "log")
    (a_label, a_x, a_y), (_, b_x, b_y), (ref_label, _, ref_y) = saved.lines()
    assert (a_label, a_x, a_y) == ("a", [0.0, 1.0], [2.0, 1.0])
    assert (b_x, b_y) == ([0.0, 1.0], [2.0, 1.5])
    assert ref_label == "target" and ref_y == [1.2, 1.2]
    # the file shows it: at 110 dpi the 6.4 x 4 inch figure, and more than a blank canvas
    assert saved.pixels.shape[:2] == (440, 704)
    assert saved.ink() > 0.02


def test_a_blank_figure_has_no_ink(tmp_path, saved_figures):
    """The check above can fail: an empty figure saved the same way has no ink."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 1))
    fig.savefig(tmp_path / "blank.png", dpi=50)
    plt.close(fig)
    assert saved_figures[str(tmp_path / "blank.png")].ink() == pytest.approx(0.0)
