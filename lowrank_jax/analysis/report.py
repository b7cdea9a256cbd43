"""Whole-model reports: every metric per matrix and per layer, head importance, cross-layer CKA of
the KV cache's keys, and the PNG plots of ``lowrank-jax analyze`` (host-side).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re

import jax.numpy as jnp
import numpy as np

from lowrank_jax.analysis.cka import cka_matrix
from lowrank_jax.core.svd import singular_values_gram
from lowrank_jax.core.rank import anisotropy, isotropy_partition
from lowrank_jax.analysis.spectra import compare_matrices, matrix_summary

# A fixed English passage (our own text) for the key-CKA probe.
PASSAGE = (
    "The old lighthouse keeper climbed the narrow stairs every evening before sunset. From the "
    "top of the tower he could see the fishing boats returning to the harbour, the gulls circling "
    "above the nets, and the long line of cliffs that ran north toward the next village. He wrote "
    "the weather in a small notebook: the direction of the wind, the height of the waves, the "
    "colour of the sky. Years later his granddaughter found the notebooks in a wooden box and "
    "read them one winter, page after page, until she knew the sea as well as he had."
)

_LAYER = re.compile(r"(?:^|/)layers/(\d+)/")


def leaf_name(keypath) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def named_matrices(params) -> list[tuple[str, int | None, np.ndarray]]:
    """Every 2-D leaf of a parameter tree as ``(path, layer index or None, float32 array)``."""
    import jax

    out = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.ndim(leaf) != 2:
            continue
        name = leaf_name(keypath)
        match = _LAYER.search(name)
        out.append((name, int(match.group(1)) if match else None, leaf))
    return out


def compare_to_random_update(base, tuned, *, k: int = 8, seed: int = 0) -> dict[str, dict]:
    """:func:`~lowrank_jax.analysis.spectra.compare_matrices` of every 2-D leaf of ``tuned``
    against ``base``, with the baseline of a random update of the same Frobenius norm.

    The baseline says how much of a change of that size an unstructured update puts into the
    spectrum: ``random_update_spectral_share`` and ``random_update_left_diag_overlap`` (one
    Gaussian direction per matrix, in leaf order, from ``np.random.default_rng(seed)``).

    Example::

        >>> import numpy as np
        >>> w = np.random.default_rng(1).normal(size=(64, 48))
        >>> rec = compare_to_random_update({"w": w}, {"w": 1.1 * w})["w"]  # a pure rescale
        >>> round(rec["spectral_share"], 6), rec["random_update_spectral_share"] < 0.3
        (1.0, True)
    """
    base_mats = {n: np.asarray(w) for n, _, w in named_matrices(base)}
    rng = np.random.default_rng(seed)
    out = {}
    for name, _, w in named_matrices(tuned):
        w0, w1 = base_mats[name], np.asarray(w)
        out[name] = compare_matrices(w0, w1, k=k)
        noise = rng.normal(size=w0.shape)
        noise *= np.linalg.norm(w1 - w0) / np.linalg.norm(noise)
        rand = compare_matrices(w0, w0 + noise, k=k)
        out[name]["random_update_spectral_share"] = rand["spectral_share"]
        out[name]["random_update_left_diag_overlap"] = rand["left_diag_overlap"]
    return out


def spectrum(matrix, *, block_rows: int = 4096) -> np.ndarray:
    """Singular values (descending, float64) by the Gram backend, ``σ = sqrt(eig(WᵀW))`` on the
    smaller side, accumulated in float64 over row blocks.

    DERIVED choice: Gram instead of a full SVD for every matrix (5–20× cheaper on CPU). In float64
    it loses relative accuracy only below ``σ_i ≈ 1e-8·σ_1``, far under every threshold used here
    (numerical rank uses ``σ² > 1e-5·σ_1²``).
    """
    m = np.asarray(matrix, dtype=np.float32)
    if m.shape[0] < m.shape[1]:
        m = m.T
    return singular_values_gram(m[i:i + block_rows] for i in range(0, m.shape[0], block_rows))


def analyze_params(params, *, layer_filter: str | None = None, base=None, top_k: int = 8) -> dict:
    """Metrics of every (filtered) matrix, plus Diffract's comparison fields when ``base`` is given.

    Args:
      params: parameter tree (pure dict of a Llama; 2-D leaves are analysed).
      layer_filter: regex searched in each leaf path (e.g. ``"self_attn"`` or ``"layers/1[0-9]/"``).
      base: optional base tree of the same architecture (the checkpoint this one was tuned from).
      top_k: components in the singular-vector overlaps.

    Returns:
      ``{"matrices": {path: metrics}, "spectra": {path: [σ...]}}``.

    Raises:
      ValueError: when the filter matches nothing, or base has a different architecture.
    """
    mats = named_matrices(params)
    if layer_filter is not None:
        pattern = re.compile(layer_filter)
        mats = [m for m in mats if pattern.search(m[0])]
        if not mats:
            names = [n for n, _, _ in named_matrices(params)]
            raise ValueError(
                f"layers={layer_filter!r} matches no matrix; paths look like {names[:3]}."
            )
    base_mats = {}
    if base is not None:
        base_mats = {n: w for n, _, w in named_matrices(base)}
        for name, _, w in mats:
            if name not in base_mats or np.shape(base_mats[name]) != np.shape(w):
                raise ValueError(
                    f"checkpoints have different architectures: {name} is {np.shape(w)} in the "
                    f"model but {np.shape(base_mats.get(name))} in the comparison checkpoint."
                )
    results, spectra = {}, {}
    for name, layer, w in mats:
        s = spectrum(w)
        w32 = jnp.asarray(np.asarray(w, np.float32))
        rec = matrix_summary(w32, s=jnp.asarray(s))
        rec["layer"] = layer
        if name in base_mats:
            w0 = jnp.asarray(np.asarray(base_mats[name], np.float32))
            rec.update({f"vs_base/{k}": v for k, v in compare_matrices(w0, w32, k=top_k).items()})
        results[name] = rec
        spectra[name] = [float(x) for x in s]
    return {"matrices": results, "spectra": spectra}


def unembedding_report(matrix) -> dict:
    """Effective rank, stable rank, anisotropy and isotropy of an unembedding ``[V, d]`` (rows =
    token vectors). Tied models: pass the input embedding (do not count it twice)."""
    m = np.asarray(matrix, dtype=np.float32)
    s = spectrum(m)
    rec = matrix_summary(jnp.asarray(m), s=jnp.asarray(s))
    rec["anisotropy"] = float(anisotropy(jnp.asarray(m)))
    rec["isotropy"] = float(isotropy_partition(jnp.asarray(m)))
    return rec


def layer_keys(model, tokens) -> list[np.ndarray]:
    """Keys each layer writes to the KV cache (post-RoPE) for one sequence.

    Returns one ``[T, kv_heads·d_h]`` array per layer.
    """
    from lowrank_jax.models.llama import KVCache

    tokens = jnp.asarray(tokens, jnp.int32).reshape(1, -1)
    cache = KVCache.empty(model.cfg, 1, max_len=tokens.shape[1], dtype=jnp.float32)
    from flax import nnx

    _, cache = nnx.jit(lambda m, t, c: m(t, cache=c))(model, tokens, cache)
    keys = np.asarray(cache.keys)  # [L, 1, T, hk, d]
    return [keys[i, 0].reshape(keys.shape[2], -1) for i in range(keys.shape[0])]


def key_cka(model, tokens, *, unbiased: bool = True) -> np.ndarray:
    """Cross-layer linear CKA of the cached keys (rows = positions of the passage)."""
    reps = [jnp.asarray(k) for k in layer_keys(model, tokens)]
    return np.asarray(cka_matrix(reps, unbiased=unbiased))


def per_layer_table(results: dict, metric: str) -> dict[str, list]:
    """``{projection: [metric per layer]}`` from :func:`analyze_params` output."""
    table: dict[str, dict[int, float]] = {}
    for name, rec in results["matrices"].items():
        if rec.get("layer") is None or metric not in rec:
            continue
        proj = _LAYER.sub("", name).rsplit("/", 1)[0]
        table.setdefault(proj, {})[rec["layer"]] = rec[metric]
    return {p: [v[i] for i in sorted(v)] for p, v in sorted(table.items())}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_spectra(spectra: dict, path: str, *, max_lines: int = 40) -> None:
    """Log-log singular-value curves (normalised by σ_1) of up to ``max_lines`` matrices."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(spectra)[:max_lines]
    cmap = plt.get_cmap("viridis")
    for i, name in enumerate(names):
        s = np.asarray(spectra[name])
        s = s[s > 0]
        ax.loglog(np.arange(1, s.size + 1), s / s[0], color=cmap(i / max(len(names) - 1, 1)),
                  lw=0.8, alpha=0.8)
    ax.set_xlabel("index i")
    ax.set_ylabel("σ_i / σ_1")
    ax.set_title(f"singular-value spectra ({len(names)} matrices, dark = first)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_by_layer(table: dict, path: str, *, ylabel: str = "effective rank") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for proj, values in table.items():
        ax.plot(range(len(values)), values, marker="o", ms=3, label=proj.split("/")[-1])
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmap(matrix, path: str, *, title: str, xlabel: str, ylabel: str,
                 vmin=None, vmax=None) -> None:
    plt = _plt()
    m = np.asarray(matrix)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m, aspect="auto", cmap="magma", vmin=vmin, vmax=vmax, origin="upper")
    fig.colorbar(im, ax=ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_panels(panels, path, *, suptitle: str | None = None, figsize=None,
                dpi: int = 120) -> None:
    """Curves on side-by-side axes, one per entry of ``panels``; the figure saved to ``path``
    (parent folders created).

    Each panel is a dict with ``curves`` and optional axes settings: ``xlabel``, ``ylabel``,
    ``title``, ``xscale`` / ``yscale`` (``"linear"``, ``"log"`` or ``"log2"``), ``ylim``,
    ``hlines`` / ``vlines`` (``(y, label, style)`` / ``(x, label, style)`` grey reference
    lines, ``label`` may be ``None``), ``legend`` (``False``: none), ``legend_fontsize``
    (default 7) and ``grid`` (bool). Each curve is a dict with ``y``, optional ``x`` (default
    ``0, 1, ...``), ``style`` (a matplotlib format string such as ``"o-"``, ``"--"``, or ``"o"``
    for points only), ``band`` (``(low, high)``: a shaded region), ``annotate`` (one text per
    point), and any ``matplotlib`` ``plot`` keywords (``label``, ``color``, ``alpha``, ``lw``,
    ``ms``, ...).

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
        >>> plot_panels([{"curves": [{"y": [3.0, 2.0, 1.5], "label": "train"}],
        ...               "xlabel": "step", "hlines": [(1.0, "target", "--")]}], path)
        >>> os.path.getsize(path) > 0
        True
    """
    plt = _plt()
    panels = list(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=figsize or (5.5 * len(panels) + 0.5, 4.2),
                             squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for curve in panel["curves"]:
            y = np.asarray(curve["y"], float)
            x = np.arange(len(y)) if curve.get("x") is None else np.asarray(curve["x"])
            keywords = {k: v for k, v in curve.items()
                        if k not in ("x", "y", "style", "band", "annotate")}
            line = ax.plot(x, y, curve.get("style", "-"), **keywords)[0]
            if curve.get("band") is not None:
                low, high = curve["band"]
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
            for text, xi, yi in zip(curve.get("annotate") or (), x, y):
                ax.annotate(text, (xi, yi), fontsize=6)
        for y, label, style in panel.get("hlines", ()):
            ax.axhline(y, color="gray", ls=style, lw=1, label=label)
        for x, label, style in panel.get("vlines", ()):
            ax.axvline(x, color="gray", ls=style, lw=1, label=label)
        for set_scale, scale in ((ax.set_xscale, panel.get("xscale")),
                                 (ax.set_yscale, panel.get("yscale"))):
            if scale == "log2":
                set_scale("log", base=2)
            elif scale:
                set_scale(scale)
        ax.set(xlabel=panel.get("xlabel", ""), ylabel=panel.get("ylabel", ""),
               title=panel.get("title", ""))
        if panel.get("ylim") is not None:
            ax.set_ylim(*panel["ylim"])
        if panel.get("grid"):
            ax.grid(alpha=0.3)
        if panel.get("legend", True):
            ax.legend(fontsize=panel.get("legend_fontsize", 7))
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_bars(labels, values, path, *, ylabel: str, title: str = "", yscale: str = "linear",
              figsize=(7, 3.5), dpi: int = 120) -> None:
    """One bar per label (tick labels slanted), saved to ``path`` (parent folders created).

    Example::

        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ppl.png")
        >>> plot_bars(["fp32", "RTN-2"], [12.0, 340.0], path, ylabel="perplexity", yscale="log")
        >>> os.path.getsize(path) > 0
        True
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=figsize)
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(values)), list(labels), rotation=30, ha="right", fontsize=8)
    ax.set_yscale(yscale)
    ax.set(ylabel=ylabel, title=title)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_curves(curves: list[dict], path, *, xlabel: str, ylabel: str, title: str = "",
                hline: tuple[float, str] | None = None, yscale: str = "linear",
                legend_fontsize=None, figsize=(6.4, 4.0), dpi: int = 110) -> None:
    """Draw curves on one axis and save the figure to ``path`` (parent folders created).

    One panel of :func:`plot_panels`.

    Args:
        curves: one dict per line: ``x``, ``y`` and any ``matplotlib`` ``plot`` keywords
            (``label``, ``color``, ``alpha``, ``lw``, ...).
        path: the image file.
        xlabel, ylabel, title: axis labels and title.
        hline: ``(value, label)`` of a dashed grey reference line (e.g. a target loss).
        yscale: ``"linear"`` or ``"log"``.
        legend_fontsize, figsize, dpi: figure options.
    """
    plot_panels([{"curves": curves, "xlabel": xlabel, "ylabel": ylabel, "title": title,
                  "hlines": [] if hline is None else [(hline[0], hline[1], "--")],
                  "yscale": yscale, "legend_fontsize": legend_fontsize}],
                path, figsize=figsize, dpi=dpi)


def plot_grid_heatmaps(grids: dict, path: str, *, xticks, yticks, xlabel: str, ylabel: str,
                       colorbar: str, vmax: float | None = None, near: float = 0.01) -> None:
    """One heatmap panel per entry of ``grids`` (a sweep's scores, lower is better), on one
    colour scale; ★ marks each panel's best cell and ○ the cells within ``near`` of it.

    ``grids[name]`` is ``[len(yticks), len(xticks)]``; NaN / inf cells (diverged runs) are gray.
    ``vmax`` caps the colour scale (e.g. at the initial loss).
    """
    plt = _plt()
    grids = {name: np.asarray(g, float) for name, g in grids.items()}
    finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()])
    low, high = float(finite.min()), float(finite.max())
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("lightgray")
    fig, axes = plt.subplots(1, len(grids), figsize=(3.9 * len(grids) + 1.0, 4.0), squeeze=False,
                             sharey=True, layout="constrained")
    for k, (ax, (name, g)) in enumerate(zip(axes[0], grids.items())):
        g = np.where(np.isfinite(g), g, np.nan)
        image = ax.imshow(np.ma.masked_invalid(g), origin="lower", aspect="auto", cmap=cmap,
                          vmin=low, vmax=high if vmax is None else min(high, vmax))
        ax.set_xticks(range(len(xticks)), list(xticks), rotation=90, fontsize=7)
        ax.set_yticks(range(len(yticks)), list(yticks), fontsize=7)
        ax.set_xlabel(xlabel)
        if k == 0:
            ax.set_ylabel(ylabel)
        best = np.nanmin(g)
        i, j = np.unravel_index(np.nanargmin(g), g.shape)
        close = g <= best * (1 + near)
        rows, cols = np.nonzero(close)
        ax.plot(cols, rows, ls="", marker="o", mfc="none", mec="white", ms=7)
        ax.plot(j, i, marker="*", color="red", ms=10)
        ax.set_title(f"{name}: best {best:.3f}\n○ {int(close.sum())} cells within "
                     f"{100 * near:g}% of it", fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9, label=colorbar)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_frames(clips, labels, path: str, *, dpi: int = 110) -> None:
    """One row of frames per clip (``[frames, h, w, 3]`` in ``[-1, 1]``), labelled on the left.

    Example::

        >>> import tempfile, os, numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "f.png")
        >>> plot_frames([np.zeros((2, 4, 4, 3))] * 2, ["a", "b"], path)
        >>> os.path.exists(path)
        True
    """
    plt = _plt()
    clips = [np.asarray(c) for c in clips]
    frames = clips[0].shape[0]
    fig, axes = plt.subplots(len(clips), frames, figsize=(frames * 0.9, len(clips) * 1.0),
                             squeeze=False)
    for i, clip in enumerate(clips):
        for f in range(frames):
            ax = axes[i, f]
            ax.imshow((clip[f] + 1) / 2, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if f == 0:
                ax.set_ylabel(labels[i], fontsize=6, rotation=0, ha="right", va="center")
    fig.tight_layout(pad=0.2)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _clean(obj):
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return None if math.isnan(v) or math.isinf(v) else v
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    return obj


def write_json(obj, path: str) -> None:
    """JSON with NaN/inf written as null and numpy types converted."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(obj), f, indent=1)


__all__ = [
    "PASSAGE", "analyze_params", "compare_to_random_update", "key_cka", "layer_keys",
    "named_matrices", "per_layer_table", "plot_bars", "plot_by_layer", "plot_curves",
    "plot_frames", "plot_grid_heatmaps", "plot_heatmap", "plot_panels", "plot_spectra",
    "spectrum", "unembedding_report",
    "write_json",
]
