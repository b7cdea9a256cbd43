"""The ``lowrank-jax analyze`` report of one model: weight spectra and effective ranks, the
unembedding, head importance (vs a base, or per-head ranks), and the cross-layer CKA of the keys
the model caches on a passage (through the one forward), with its plots."""

from __future__ import annotations

import os

import numpy as np

from lowrank_jax.analysis import report
from lowrank_jax.analysis.heads import head_scores, head_slices
from lowrank_jax.core.rank import effective_rank_of


def model_report(model, params: dict, token_ids, *, out: str, base: dict | None = None,
                 layer_filter: str | None = None, top_k: int = 8) -> dict:
    """Compute the report of ``model`` (``params`` = its pure-dict parameters), write the PNGs
    into ``out`` and return the results dict (``report.write_json`` saves it).

    Args:
        model: a :class:`~lowrank_jax.models.llama.Llama`.
        params: ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``.
        token_ids: the passage whose cached keys are compared across layers.
        out: output folder (created).
        base: parameters of a base model of the same architecture (update analysis).
        layer_filter: regex on matrix paths.
        top_k: singular values / directions kept per matrix.
    """
    cfg = model.cfg
    results = report.analyze_params(params, layer_filter=layer_filter, base=base, top_k=top_k)
    os.makedirs(out, exist_ok=True)

    if cfg.tie_embeddings or params.get("lm_head") is None:
        unembed = params["embed_tokens"]["embedding"]
    else:
        unembed = np.asarray(params["lm_head"]["kernel"]).T
    results["unembedding"] = report.unembedding_report(unembed)
    results["unembedding"]["tied"] = bool(cfg.tie_embeddings)

    if base is not None:
        scores = {c: head_scores(base, params, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads,
                                 criterion=c, k=top_k) for c in ("rel_update", "rotation")}
        results["head_scores"] = scores
        heat, title = scores["rel_update"], "head importance (relative update, vs base)"
    else:
        heat = np.zeros((cfg.n_layers, cfg.n_heads))
        for i in range(cfg.n_layers):
            sl = head_slices(params, i, num_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads)
            for h in range(cfg.n_heads):
                heat[i, h] = float(effective_rank_of(sl["q_proj"][h]))
        results["head_q_effective_rank"] = heat
        title = "per-head effective rank of q slices (no --compare given)"
    report.plot_heatmap(heat, os.path.join(out, "head_importance.png"), title=title,
                        xlabel="query head", ylabel="layer")

    cka = report.key_cka(model, np.asarray(token_ids))
    results["key_cka"] = {"matrix": cka, "tokens": len(token_ids),
                          "estimator": "unbiased linear CKA",
                          "adjacent_mean": float(np.mean(np.diag(cka, 1))) if len(cka) > 1
                          else None}
    report.plot_heatmap(cka, os.path.join(out, "key_cka.png"),
                        title=f"linear CKA of cached keys across layers ({len(token_ids)} tokens)",
                        xlabel="layer", ylabel="layer", vmin=0.0, vmax=1.0)
    report.plot_spectra(results["spectra"], os.path.join(out, "spectra.png"))
    table = report.per_layer_table(results, "effective_rank")
    results["effective_rank_by_layer"] = table
    if table:
        report.plot_by_layer(table, os.path.join(out, "effective_rank_by_layer.png"))
    return results


__all__ = ["model_report"]
