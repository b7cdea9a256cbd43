"""How well each coreset estimates a mean loss: the error table of the data-selection methods.

For the low-rank residual coreset of :mod:`lowrank_jax.data.selection` and its two baselines
(uniform sampling, k-means sensitivity sampling), :func:`coreset_error_table` measures the
relative error of the weighted subset mean against the full mean, and the oracle calls spent.

References:
    Cohen-Addad et al, `Active Learning with Low-Rank Structure for Data Selection
    <https://arxiv.org/abs/2606.16045>`_, ICML 2026; Axiotis et al, ICML 2024.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.data import selection as sel


def coreset_error_table(A, losses, budgets, ranks, reps: int, seed: int, *,
                        lipschitz_kmeans: float | None = None) -> dict:
    """``{method: {f"m={m},k={k}": (median, p90, oracle calls)}}``: the relative error
    ``|L̂ − L̄| / L̄`` of each coreset's weighted loss mean, over ``reps`` keys per cell.

    Methods: ``uniform`` (``m`` oracle calls), ``kmeans_sensitivity`` (``4k`` clusters, Lipschitz
    constant ``lipschitz_kmeans`` or the median one the low-rank fit finds; ``4k + m`` calls) and
    ``lowrank_residual`` (``4k + m`` calls), for every budget ``m`` and rank ``k``.

    Args:
        A: ``[n, d]`` embeddings.
        losses: ``[n]`` per-row losses (the oracle).
        budgets: the sample counts ``m``.
        ranks: the ranks ``k``.
        reps: keys per cell.
        seed: the keys' seed (``seed + 1`` for the low-rank fit).
        lipschitz_kmeans: the k-means baseline's Lipschitz constant (default: estimated).

    Example::

        >>> import jax
        >>> A, losses, _ = sel.synthetic_lowrank_losses(jax.random.key(0), n=400, d=8, rank=2)
        >>> table = coreset_error_table(A, losses, (40,), (2,), reps=2, seed=0)
        >>> sorted(table), table["uniform"]["m=40,k=2"][2]
        (['kmeans_sensitivity', 'lowrank_residual', 'uniform'], 40)
    """
    A, losses = jnp.asarray(A), jnp.asarray(losses)
    lbar = float(losses.mean())
    oracle = lambda i: losses[i]
    keys = jax.random.split(jax.random.key(seed), reps)
    rows = {}
    for k in ranks:
        fit = sel.lowrank_residuals(jax.random.key(seed + 1), A, k)
        lam = jax.jit(jax.vmap(lambda key, k=k, fit=fit: sel.lowrank_coreset(
            key, A, oracle, num_samples=16, rank=k, fit=fit).lipschitz))(keys)
        lam_km = float(jnp.median(lam)) if lipschitz_kmeans is None else lipschitz_kmeans
        for m in budgets:
            def err(cs):
                return sel.relative_error(sel.weighted_mean(losses[cs.idx], cs.weights), lbar)

            def uniform(key, m=m):
                return err(sel.uniform_coreset(key, A.shape[0], m))

            def kmeans(key, m=m, k=k, lam_km=lam_km):
                return err(sel.kmeans_sensitivity_coreset(
                    key, A, oracle, num_clusters=4 * k, num_samples=m, lipschitz=lam_km))

            def lowrank(key, m=m, k=k, fit=fit):
                return err(sel.lowrank_coreset(key, A, oracle, num_samples=m, rank=k, fit=fit))

            runs = {"uniform": (uniform, m), "kmeans_sensitivity": (kmeans, 4 * k + m),
                    "lowrank_residual": (lowrank, 4 * k + m)}
            for name, (fn, calls) in runs.items():
                e = np.asarray(jax.jit(jax.vmap(fn))(keys))
                rows.setdefault(name, {})[f"m={m},k={k}"] = (
                    float(np.median(e)), float(np.percentile(e, 90)), calls)
    return rows


__all__ = ["coreset_error_table"]
