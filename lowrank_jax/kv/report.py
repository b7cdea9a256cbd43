"""Reading a KV-cache sweep: progress lines, Markdown tables and plots of its rows.

:func:`~lowrank_jax.kv.evaluate.summarize_sweep` rows (labelled settings, vs the exact cache) get
:func:`sweep_table` and :func:`plot_sweep`; the xKV grid of (method, ratio, sink tokens, group
size) gets :func:`summarize_grid` and :func:`plot_grid`. Host-side, no model.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def record_line(label: str, rec: dict) -> str:
    """One progress line of a sweep record (or of an unreachable setting).

    Example::

        >>> record_line("KIVI", {"window": 0, "target_ratio": 16.0, "unreachable": "no"})
        '  w0 KIVI @ 16.0x: unreachable'
    """
    if "unreachable" in rec:
        return f"  w{rec['window']} {label} @ {rec['target_ratio']}x: unreachable"
    return (f"  w{rec['window']} {label} @ {rec['target_ratio']}: {rec['compression_ratio']:.2f}x "
            f"ppl {rec['perplexity']:.3f} K {rec['key_error']:.3f} V {rec['value_error']:.3f} "
            f"ranks {rec.get('rank_k')}/{rec.get('rank_v')}")


def sweep_table(rows: Sequence[dict]) -> list[str]:
    """The Markdown lines of :func:`summarize_sweep`'s rows (perplexity vs the exact cache).

    Example::

        >>> rows = [dict(label="exact cache", method="none", target=None, actual=1.0,
        ...              perplexity=9.0, vs_exact=0.0, key_error=0.0, value_error=0.0,
        ...              windows=[9.0])]
        >>> sweep_table(rows)[-1]
        '| exact cache | – | 1.00× | 9.00 | – | 0.000 | 0.000 | 9.00 |'
    """
    lines = ["| method | target | actual | ppl | vs exact | K err | V err | per-window ppl |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        target = "–" if r["target"] is None else f"{r['target']:g}×"
        if "unreachable" in r:
            lines.append(f"| {r['label']} | {target} | unreachable | – | – | – | – | – |")
            continue
        vs = "–" if r["method"] == "none" else f"{100 * r['vs_exact']:+.1f} %"
        wins = " / ".join(f"{p:.2f}" for p in r["windows"])
        lines.append(f"| {r['label']} | {target} | {r['actual']:.2f}× | {r['perplexity']:.2f} | "
                     f"{vs} | {r['key_error']:.3f} | {r['value_error']:.3f} | {wins} |")
    return lines


def plot_sweep(rows: Sequence[dict], path: str) -> None:
    """Perplexity vs the compression reached, one curve per label of :func:`summarize_sweep`'s
    rows, with the exact cache and +3 % / +10 % of it as horizontal lines."""
    from lowrank_jax.analysis.report import plot_panels

    exact = [r["perplexity"] for r in rows if r["method"] == "none"]
    hlines = [] if not exact else [(exact[0], "exact cache (fp16)", "--"),
                                   (exact[0] * 1.03, "exact +3 %", ":"),
                                   (exact[0] * 1.10, "exact +10 %", "-.")]
    curves = []
    for label in dict.fromkeys(r["label"] for r in rows if r["method"] != "none"):
        pts = sorted((r["actual"], r["perplexity"]) for r in rows
                     if r["label"] == label and "unreachable" not in r)
        if pts:
            curves.append({"x": [p[0] for p in pts], "y": [p[1] for p in pts], "style": "o-",
                           "label": label})
    plot_panels([{"curves": curves, "hlines": hlines, "xscale": "log2",
                  "xlabel": "KV-cache compression (exact fp16 bytes / stored bytes, all counted)",
                  "ylabel": "perplexity (held-out windows)"}], path, figsize=(6.5, 4))


def summarize_grid(settings: Sequence[tuple], records: Sequence[dict]) -> list[dict]:
    """One row per ``(method, ratio, sink tokens, group size)`` of an xKV sweep's records.

    ``records`` are :func:`xkv_perplexity_sweep` records over windows; a setting takes those of
    its method and target ratio whose ``sink_tokens`` / ``group_size`` match it (or are
    ``None``: a method without that option). A row has the perplexity ``exp(mean NLL)``, the
    mean compression ratio and key / value errors, the first record's ranks and the per-window
    perplexities.

    Example::

        >>> recs = [dict(method="xkv", target_ratio=2.0, sink_tokens=0, group_size=4, nll=0.0,
        ...              compression_ratio=2.5, rank_k=3, rank_v=2, perplexity=1.0,
        ...              key_error=0.1, value_error=0.2)]
        >>> row = summarize_grid([("xkv", 2.0, 0, 4)], recs)[0]
        >>> row["perplexity"], row["compression_ratio"], row["window_perplexities"]
        (1.0, 2.5, [1.0])
    """
    rows = []
    for method, ratio, sink_n, group in settings:
        sel = [r for r in records if r["method"] == method and r["target_ratio"] == ratio
               and r["sink_tokens"] in (sink_n, None) and r["group_size"] in (group, None)]
        rows.append(dict(
            method=method, target_ratio=ratio, sink_tokens=sink_n, group_size=group,
            compression_ratio=float(np.mean([r["compression_ratio"] for r in sel])),
            rank_k=sel[0]["rank_k"], rank_v=sel[0]["rank_v"],
            perplexity=math.exp(float(np.mean([r["nll"] for r in sel]))),
            window_perplexities=[r["perplexity"] for r in sel],
            key_error=float(np.mean([r["key_error"] for r in sel])),
            value_error=float(np.mean([r["value_error"] for r in sel])),
        ))
    return rows


def plot_grid(rows: Sequence[dict], path: str) -> None:
    """Perplexity vs compression ratio of :func:`summarize_grid`'s rows: one curve per
    (method, group size, sink tokens), dashed for the paper's settings (no sink)."""
    from lowrank_jax.analysis.report import plot_panels

    exact = [r["perplexity"] for r in rows if r["method"] == "none"][0]
    curves = []
    for method, group, sink in sorted({(r["method"], r["group_size"], r["sink_tokens"])
                                       for r in rows if r["method"] != "none"}):
        pts = [(r["compression_ratio"], r["perplexity"]) for r in rows
               if (r["method"], r["group_size"], r["sink_tokens"]) == (method, group, sink)]
        marker = {"xkv": "o", "per_layer_svd": "s"}[method]
        label = f"{method} (G={group})" + (f" + {sink} sink" if sink else ", paper")
        curves.append({"x": [p[0] for p in pts], "y": [p[1] for p in pts],
                       "style": marker + ("-" if sink else "--"), "label": label})
    plot_panels([{"curves": curves, "hlines": [(exact, "exact cache", "--")], "xscale": "log2",
                  "xlabel": "KV-cache compression ratio", "ylabel": "perplexity"}], path,
                figsize=(6, 4))


__all__ = ["plot_grid", "plot_sweep", "record_line", "summarize_grid", "sweep_table"]
