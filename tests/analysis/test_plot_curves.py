"""The shared curve plot writes a PNG."""

from lowrank_jax.analysis.report import plot_curves


def test_plot_curves_writes_the_image(tmp_path):
    path = tmp_path / "img" / "curves.png"
    plot_curves([{"x": [0, 1], "y": [2.0, 1.0], "label": "a"}, {"x": [0, 1], "y": [2.0, 1.5]}],
                path, xlabel="step", ylabel="loss", hline=(1.2, "target"), yscale="log")
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
