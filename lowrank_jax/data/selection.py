"""Data selection by a rank-k fit and residual (sensitivity) sampling: weighted coresets.

Pick ``m`` weighted rows of a training set whose weighted loss estimates the full average loss
``L̄ = (1/n) Σ_i ℓ_i``, querying the loss (labels, model) only on few rows. The embedding matrix
``A[n, d]`` is assumed close to a rank-k subspace: fit it, query ``k'`` representative rows, fit a
proxy ``ĥ`` of the in-subspace loss, and sample

.. math:: s_i = ĥ_i + λ r_i,\\quad p_i = (1-η)\\,s_i/Σ_j s_j + η/n,\\quad
   w_t = 1/(m\\,n\\,p_{j_t}),\\quad \\hat L = Σ_t w_t ℓ_{j_t}

with ``r_i`` the squared distance of row ``i`` to the subspace. If ``|ℓ_i − ĥ_i| ≤ λ r_i`` then
``Var(L̂) ≤ (L̄ + λΦ_k/n)²/m`` with ``Φ_k = Σ r_i``, so ``m = O(1/ε²)`` samples give
``|L̂ − L̄| ≤ ε L̄ + ε λ Φ_k / n``. Baselines: uniform sampling and k-means sensitivity sampling.
Algorithmic details are derived (see ``shared/specs/data_selection.md``).

Example::

    >>> import jax, jax.numpy as jnp
    >>> A = (jax.random.normal(jax.random.key(0), (500, 3))
    ...      @ jax.random.normal(jax.random.key(1), (3, 16)))
    >>> losses = 1.0 + jnp.abs(A[:, 0])
    >>> cs = lowrank_coreset(jax.random.key(2), A, lambda i: losses[i], rank=3, num_samples=64)
    >>> bool(abs(weighted_mean(losses[cs.idx], cs.weights) / losses.mean() - 1) < 0.2)
    True

References:
    Cohen-Addad, Kunapuli, Mirrokni, Nikdan, Woodruff, Zhou, `Active Learning with Low-Rank
    Structure for Data Selection <https://arxiv.org/abs/2606.16045>`_, ICML 2026.
    Axiotis et al, `Data-Efficient Learning via Clustering-Based Sensitivity Sampling
    <https://arxiv.org/abs/2402.17327>`_, ICML 2024.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from lowrank_jax.data.embed import chunk_tokens, text_embeddings
from lowrank_jax.data.kmeans import kmeans
from lowrank_jax.core.linalg import randomized_svd

LossOracle = Callable[[jax.Array], jax.Array]


class LowRankFit(NamedTuple):
    """Rank-k fit of ``A``: basis ``V[d,k]``, singular values, coordinates ``c = AV``, residuals."""

    V: Float[Array, "d k"]
    sing: Float[Array, " k"]
    coords: Float[Array, "n k"]
    resid: Float[Array, " n"]  # squared distance of each row to span(V), >= 0
    phi: Float[Array, ""]  # Σ resid = Φ_k (exact basis) or slightly above (randomized)


class Coreset(NamedTuple):
    """Sampled rows ``idx`` with weights for the *average* loss (duplicates merged).

    Merged duplicates leave padding slots: an index repeated with weight 0, so the weighted
    loss is unchanged (``compact`` drops them).
    """

    idx: Int[Array, " m"]
    weights: Float[Array, " m"]
    rep_idx: Int[Array, " r"]  # rows queried to build the sampling distribution
    probs: Float[Array, " n"]
    phi: Float[Array, ""]
    lipschitz: Float[Array, ""]


def _check_matrix(A, name="A"):
    if getattr(A, "ndim", None) != 2:
        raise ValueError(f"{name} must be a 2-D [n, d] embedding matrix, got shape "
                         f"{getattr(A, 'shape', None)}; reshape or stack your embeddings.")


def _check_rank(rank, n, d):
    if not isinstance(rank, int) or not 1 <= rank <= min(n, d):
        raise ValueError(f"rank={rank!r} must be an int in [1, min(n, d)] = [1, {min(n, d)}].")


def _normalize(A):
    return A / jnp.maximum(jnp.linalg.norm(A, axis=1, keepdims=True), 1e-30)


def _project(A, V, sing):
    coords = A @ V
    off = A - coords @ V.T  # ‖a − VVᵀa‖² directly: ‖a‖² − ‖c‖² cancels badly in float32
    resid = jnp.sum(off * off, axis=1)
    return LowRankFit(V, sing, coords, resid, jnp.sum(resid))


def lowrank_residuals(
    key: jax.Array,
    A: Float[Array, "n d"],
    rank: int,
    *,
    method: str = "randomized",
    oversample: int = 10,
    power_iterations: int = 2,
    normalize_rows: bool = False,
) -> LowRankFit:
    """Top-``rank`` right singular subspace of ``A`` and each row's residual to it.

    ``c_i = Vᵀa_i``, ``r_i = max(‖a_i‖² − ‖c_i‖², 0)``, ``Φ̂ = Σ r_i`` (``= Σ_{j>k} σ_j²`` for
    ``method="exact"``). ``method="gram"`` uses ``eigh(AᵀA)`` (cheap for d ≪ n);
    ``normalize_rows=True`` is the angular mode (``r_i = sin²∠(a_i, span V)``). Jit-able with
    static ``rank``/``method``. For matrices larger than memory use
    :func:`lowrank_residuals_chunked`.

    Args:
        key: PRNG key (used by ``"randomized"``).
        A: ``[n, d]`` embeddings.
        rank: ``k``.
        method: ``"randomized"`` | ``"exact"`` | ``"gram"``.
        oversample, power_iterations: randomized SVD parameters.
        normalize_rows: divide each row by its norm first.

    Returns:
        :class:`LowRankFit`.
    """
    _check_matrix(A)
    n, d = A.shape
    _check_rank(rank, n, d)
    A = jnp.asarray(A, jnp.float32)
    if normalize_rows:
        A = _normalize(A)
    if method == "randomized":
        _, sing, vt = randomized_svd(A, rank, oversample=oversample,
                                     power_iters=power_iterations, key=key)
        V = vt.T
    elif method == "exact":
        _, s, vt = jnp.linalg.svd(A, full_matrices=False)
        V, sing = vt[:rank].T, s[:rank]
    elif method == "gram":
        evals, evecs = jnp.linalg.eigh(A.T @ A)
        V = evecs[:, ::-1][:, :rank]
        sing = jnp.sqrt(jnp.maximum(evals[::-1][:rank], 0.0))
    else:
        raise ValueError(f"method={method!r} must be 'randomized', 'exact' or 'gram'.")
    return _project(A, V, sing)


def lowrank_residuals_chunked(
    A, rank: int, *, chunk_rows: int = 65536, normalize_rows: bool = False
) -> LowRankFit:
    """:func:`lowrank_residuals` in two streaming passes over row blocks (``method="gram"``).

    Pass 1 accumulates ``AᵀA`` in float64 on the host, pass 2 projects each block; only one block
    of ``A`` is in memory at a time, so ``A`` may be a ``np.load(path, mmap_mode="r")`` memmap
    larger than memory. Output holds only ``n×k`` coordinates and ``n`` residuals.

    Args:
        A: anything with ``.shape == (n, d)`` and row slicing (``np.ndarray``, memmap).
        rank: ``k``.
        chunk_rows: rows per block.
        normalize_rows: angular mode.
    """
    _check_matrix(A)
    n, d = A.shape
    _check_rank(rank, n, d)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} must be a positive int.")

    def blocks():
        for lo in range(0, n, chunk_rows):
            block = np.asarray(A[lo:lo + chunk_rows], np.float64)
            if normalize_rows:
                block = block / np.maximum(np.linalg.norm(block, axis=1, keepdims=True), 1e-30)
            yield block

    gram = np.zeros((d, d), np.float64)
    for block in blocks():
        gram += block.T @ block
    evals, evecs = np.linalg.eigh(gram)
    V = evecs[:, ::-1][:, :rank]
    sing = np.sqrt(np.maximum(evals[::-1][:rank], 0.0))
    coords, resid = [], []
    for block in blocks():
        c = block @ V
        coords.append(c.astype(np.float32))
        resid.append(np.maximum(np.sum(block * block, 1) - np.sum(c * c, 1), 0.0))
    resid = np.concatenate(resid)
    return LowRankFit(jnp.asarray(V, jnp.float32), jnp.asarray(sing, jnp.float32),
                      jnp.asarray(np.concatenate(coords)), jnp.asarray(resid, jnp.float32),
                      jnp.asarray(resid.sum(), jnp.float32))


def select_representatives(
    key: jax.Array, fit: LowRankFit, num: int, *, method: str = "mixed"
) -> Int[Array, " num"]:
    """``num`` distinct representative rows to query.

    ``"leverage"``: sampled ∝ ``τ_i = ‖Σ⁻¹c_i‖²``; ``"residual"``: ∝ ``r_i`` (adaptive sampling,
    Deshpande–Vempala); ``"mixed"`` (default): half of each, so the proxy fit sees both the
    subspace directions and off-subspace rows (without the latter ``λ`` is not identifiable);
    ``"pivoted_qr"``: pivots of a pivoted QR of ``coordsᵀ`` (host SciPy, not jit-able).
    """
    n = fit.coords.shape[0]
    if not isinstance(num, int) or not 1 <= num <= n:
        raise ValueError(f"num={num!r} representatives must be an int in [1, n={n}].")
    lev = jnp.sum((fit.coords / jnp.maximum(fit.sing, 1e-30)) ** 2, axis=1) + 1e-30
    res = fit.resid + 1e-6 * jnp.mean(fit.resid) + 1e-30
    draw = lambda k, w, size: jax.random.choice(k, n, (size,), replace=False, p=w / jnp.sum(w))
    if method == "leverage":
        return draw(key, lev, num)
    if method == "residual":
        return draw(key, res, num)
    if method == "mixed":
        k_lev, k_res = jax.random.split(key)
        first = draw(k_lev, lev, num - num // 2)
        if num // 2 == 0:
            return first
        return jnp.concatenate([first, draw(k_res, res.at[first].set(0.0), num // 2)])
    if method == "pivoted_qr":
        from scipy.linalg import qr  # host-side

        _, _, piv = qr(np.asarray(fit.coords).T, pivoting=True, mode="economic")
        if num > len(piv):
            rest = np.setdiff1d(np.arange(n), piv)
            extra = np.asarray(jax.random.choice(key, rest.size, (num - len(piv),), replace=False))
            piv = np.concatenate([piv, rest[extra]])
        return jnp.asarray(piv[:num], jnp.int32)
    raise ValueError(f"method={method!r} must be 'mixed', 'leverage', 'residual' or 'pivoted_qr'.")


def _ridge_solve(X, y, ridge, penalize):
    gram = X.T @ X
    scale = jnp.trace(gram) / X.shape[1]
    return jnp.linalg.solve(gram + ridge * scale * jnp.diag(penalize) + 1e-9 * scale *
                            jnp.eye(X.shape[1]), X.T @ y)


def fit_proxy(
    fit: LowRankFit,
    rep_idx: Int[Array, " r"],
    rep_losses: Float[Array, " r"],
    *,
    lipschitz: str | float = "auto",
    kind: str = "linear",
    ridge: float = 1e-3,
    floor_frac: float = 1e-3,
) -> tuple[Float[Array, " n"], Float[Array, ""]]:
    """Proxy ``ĥ`` of the in-subspace loss from the representatives' losses, and ``λ``.

    Model ``ℓ_i ≈ h(c_i) + λ r_i``. ``kind="linear"``: ridge regression of ``ℓ_s`` on
    ``[c_s, 1, r_s]`` (``lipschitz="auto"``: the ``r`` coefficient, constrained ≥ 0, is λ; a float
    λ fits ``ℓ_s − λ r_s`` on ``[c_s, 1]``); ``"const"``: ``median(ℓ_s − λ r_s)``; ``"nearest"``:
    ``ℓ_s* − λ r_s*`` of the representative with the largest ``|cos(c_i, c_s)|``. The proxy is
    floored at ``floor_frac · mean(ℓ_s)``. ``kind="const"``/``"nearest"`` with ``"auto"`` take λ
    from the linear fit.
    """
    if kind not in ("linear", "const", "nearest"):
        raise ValueError(f"kind={kind!r} must be 'linear', 'const' or 'nearest'.")
    rep_losses = jnp.asarray(rep_losses, jnp.float32)
    if rep_losses.shape != rep_idx.shape:
        raise ValueError(f"rep_losses shape {rep_losses.shape} must match rep_idx shape "
                         f"{rep_idx.shape} (one loss per representative).")
    c_s, r_s = fit.coords[rep_idx], fit.resid[rep_idx]
    ones = jnp.ones_like(r_s)[:, None]
    X_c = jnp.concatenate([c_s, ones], axis=1)
    pen_c = jnp.concatenate([jnp.ones(c_s.shape[1]), jnp.zeros(1)])
    if lipschitz == "auto":
        X = jnp.concatenate([X_c, r_s[:, None]], axis=1)
        beta = _ridge_solve(X, rep_losses, ridge, jnp.concatenate([pen_c, jnp.zeros(1)]))
        beta0 = _ridge_solve(X_c, rep_losses, ridge, pen_c)  # fallback when the r slope is < 0
        lam = jnp.maximum(beta[-1], 0.0)
        beta_c = jnp.where(beta[-1] >= 0, beta[:-1], beta0)
    else:
        if isinstance(lipschitz, str) or float(lipschitz) < 0:
            raise ValueError(f"lipschitz={lipschitz!r} must be a float >= 0 or 'auto'.")
        lam = jnp.asarray(float(lipschitz), jnp.float32)
        beta_c = _ridge_solve(X_c, rep_losses - lam * r_s, ridge, pen_c)
    inner = rep_losses - lam * r_s
    if kind == "linear":
        proxy = fit.coords @ beta_c[:-1] + beta_c[-1]
    elif kind == "const":
        proxy = jnp.full(fit.resid.shape, jnp.median(inner))
    else:
        unit = lambda c: c / jnp.maximum(jnp.linalg.norm(c, axis=1, keepdims=True), 1e-30)
        nearest = jnp.argmax(jnp.abs(unit(fit.coords) @ unit(c_s).T), axis=1)
        proxy = inner[nearest]
    floor = floor_frac * jnp.maximum(jnp.mean(rep_losses), 1e-30)
    return jnp.maximum(proxy, floor), lam


def sensitivity_probs(
    proxy: Float[Array, " n"],
    resid: Float[Array, " n"],
    lipschitz,
    *,
    uniform_mix: float = 0.1,
) -> Float[Array, " n"]:
    """``p_i = (1−η) s_i / Σ s + η/n`` with ``s_i = max(ĥ_i, 0) + λ r_i``; jit-able."""
    if not 0.0 <= float(uniform_mix) <= 1.0:
        raise ValueError(f"uniform_mix={uniform_mix!r} must be in [0, 1] (0.1 is the default).")
    score = jnp.maximum(proxy, 0.0) + lipschitz * resid
    total = jnp.sum(score)
    n = proxy.shape[0]
    base = jnp.where(total > 0, score / jnp.where(total > 0, total, 1.0), 1.0 / n)
    return (1.0 - uniform_mix) * base + uniform_mix / n


def sample_coreset(
    key: jax.Array, p: Float[Array, " n"], num_samples: int, *, dedupe: bool = True
) -> tuple[Int[Array, " m"], Float[Array, " m"]]:
    """``m`` i.i.d. draws from ``p`` with weights ``1/(m n p_j)`` (``Σ_t w_t ℓ_{j_t}`` is unbiased
    for the mean loss). ``dedupe`` merges repeated indices by summing their weights; the freed
    slots hold an already present index with weight 0. Jit-able with static ``num_samples``."""
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be a positive int.")
    n = p.shape[0]
    idx = jax.random.choice(key, n, (num_samples,), replace=True, p=p)
    weights = 1.0 / (num_samples * n * p[idx])
    if not dedupe:
        return idx, weights
    uniq, inverse = jnp.unique(idx, return_inverse=True, size=num_samples, fill_value=idx[0])
    merged = jax.ops.segment_sum(weights, inverse.reshape(-1), num_segments=num_samples)
    return uniq, merged


def compact(idx, weights) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays of the distinct indices with positive weight (drops the padding slots)."""
    idx, weights = np.asarray(idx), np.asarray(weights)
    keep = weights > 0
    return idx[keep], weights[keep]


def _query(loss_oracle, idx):
    losses = jnp.asarray(loss_oracle(idx), jnp.float32)
    if losses.shape != idx.shape:
        raise ValueError(f"loss_oracle returned shape {losses.shape} for {idx.shape[0]} indices; "
                         "it must return one loss per index.")
    return losses


def lowrank_coreset(
    key: jax.Array,
    A: Float[Array, "n d"],
    loss_oracle: LossOracle,
    *,
    num_samples: int,
    rank: int = 32,
    num_representatives: int | None = None,
    lipschitz: str | float = "auto",
    angular: bool = False,
    method: str = "randomized",
    kind: str = "linear",
    uniform_mix: float = 0.1,
    fit: LowRankFit | None = None,
    representatives: str = "mixed",
) -> Coreset:
    """The low-rank residual coreset: fit, ``k' = 4·rank`` representatives, proxy, sample.

    ``loss_oracle(indices) -> losses`` is called once, on the ``k'`` representatives; the caller
    then evaluates the sampled rows ``idx`` itself (``weighted_mean(losses[idx], weights)``).
    Pass a precomputed ``fit`` (e.g. from :func:`lowrank_residuals_chunked`) to skip step 1.
    Deterministic given ``key``.
    """
    k_fit, k_rep, k_samp = jax.random.split(key, 3)
    if fit is None:
        fit = lowrank_residuals(k_fit, A, rank, method=method, normalize_rows=angular)
    n, k = fit.coords.shape
    num_rep = min(4 * k, n) if num_representatives is None else num_representatives
    rep_idx = select_representatives(k_rep, fit, num_rep, method=representatives)
    proxy, lam = fit_proxy(fit, rep_idx, _query(loss_oracle, rep_idx), lipschitz=lipschitz,
                           kind=kind)
    probs = sensitivity_probs(proxy, fit.resid, lam, uniform_mix=uniform_mix)
    idx, weights = sample_coreset(k_samp, probs, num_samples)
    return Coreset(idx, weights, rep_idx, probs, fit.phi, lam)


def uniform_coreset(key: jax.Array, n: int, num_samples: int) -> Coreset:
    """Uniform i.i.d. sampling baseline: ``p_i = 1/n``, weights ``1/m`` (duplicates merged)."""
    probs = jnp.full((n,), 1.0 / n)
    idx, weights = sample_coreset(key, probs, num_samples)
    return Coreset(idx, weights, jnp.zeros((0,), jnp.int32), probs, jnp.asarray(0.0),
                   jnp.asarray(0.0))


def kmeans_sensitivity_coreset(
    key: jax.Array,
    A: Float[Array, "n d"],
    loss_oracle: LossOracle,
    *,
    num_clusters: int,
    num_samples: int,
    lipschitz: float,
    power: float = 2.0,
    uniform_mix: float = 0.1,
) -> Coreset:
    """Baseline (Axiotis et al. 2024): k-means, query the row nearest each centroid, sample with
    ``s_i = ℓ(center(i)) + λ‖a_i − μ_{c(i)}‖^z`` then the same mixing and weights.

    ``rep_idx`` are the queried rows; ``phi`` is the k-means cost ``Σ_i ‖a_i − μ_{c(i)}‖^z``.
    """
    if float(lipschitz) < 0:
        raise ValueError(f"lipschitz={lipschitz!r} must be >= 0.")
    k_means, k_samp = jax.random.split(key)
    A = jnp.asarray(A, jnp.float32)
    centers, labels = kmeans(k_means, A, num_clusters)
    dist = jnp.sum((A - centers[labels]) ** 2, axis=1) ** (power / 2.0)
    to_center = (jnp.sum(A * A, 1)[:, None] - 2 * A @ centers.T
                 + jnp.sum(centers * centers, 1)[None])
    masked = jnp.where(labels[:, None] == jnp.arange(num_clusters)[None], to_center, jnp.inf)
    rep_idx = jnp.argmin(masked, axis=0)  # empty clusters fall back to row 0 (still a valid row)
    rep_losses = _query(loss_oracle, rep_idx)
    probs = sensitivity_probs(rep_losses[labels], dist, float(lipschitz), uniform_mix=uniform_mix)
    idx, weights = sample_coreset(k_samp, probs, num_samples)
    return Coreset(idx, weights, rep_idx, probs, jnp.sum(dist), jnp.asarray(float(lipschitz)))


def select_subset(
    key: jax.Array,
    A,
    budget: int,
    *,
    losses=None,
    method: str = "lowrank",
    rank: int = 32,
    angular: bool = False,
    num_clusters: int | None = None,
    chunk_rows: int | None = None,
) -> Coreset:
    """One call behind ``lowrank-jax select``: a weighted subset of ``budget`` draws.

    ``method="lowrank"`` (:func:`lowrank_coreset`), ``"kmeans"`` (k-means sensitivity, λ from
    the low-rank fit so both use the same units) or ``"uniform"``. ``losses[n]`` act as the
    oracle; without them (label-free) the loss is taken constant and the rows are drawn
    ∝ ``mean(r) + r_i`` (mixed with uniform): off-subspace rows are over-sampled and the weights
    still give an unbiased average. ``chunk_rows`` streams ``A`` (e.g. a memmap) in blocks.
    """
    _check_matrix(A)
    n, d = A.shape
    if method not in ("lowrank", "kmeans", "uniform"):
        raise ValueError(f"method={method!r} must be 'lowrank', 'kmeans' or 'uniform'.")
    if losses is not None:
        losses = jnp.asarray(losses, jnp.float32)
        if losses.shape != (n,):
            raise ValueError(f"losses has shape {losses.shape}; give one loss per row, ({n},).")
    if method == "uniform":
        return uniform_coreset(key, n, budget)
    rank = min(rank, n, d)
    k_fit, k_sel = jax.random.split(key)
    fit = (lowrank_residuals_chunked(A, rank, chunk_rows=chunk_rows, normalize_rows=angular)
           if chunk_rows else lowrank_residuals(k_fit, jnp.asarray(A), rank,
                                                normalize_rows=angular))
    if losses is None:
        if method == "kmeans":
            raise ValueError("method='kmeans' needs losses (one per row); pass `losses`, or use "
                             "method='lowrank' for label-free selection.")
        mean_r = jnp.maximum(jnp.mean(fit.resid), 1e-30)
        probs = sensitivity_probs(jnp.full((n,), mean_r), fit.resid, 1.0)
        idx, weights = sample_coreset(k_sel, probs, budget)
        return Coreset(idx, weights, jnp.zeros((0,), jnp.int32), probs, fit.phi,
                       1.0 / mean_r)
    oracle = lambda i: losses[i]
    cs = lowrank_coreset(k_sel, None, oracle, num_samples=budget, rank=rank, fit=fit)
    if method == "lowrank":
        return cs
    points = jnp.asarray(A, jnp.float32)
    if angular:
        points = _normalize(points)
    return kmeans_sensitivity_coreset(k_sel, points, oracle, num_clusters=num_clusters or 4 * rank,
                                      num_samples=budget, lipschitz=float(cs.lipschitz))


def weighted_mean(losses: Float[Array, " m"], weights: Float[Array, " m"]) -> Float[Array, ""]:
    """``Σ_t w_t ℓ_t`` (weights from a coreset already include the 1/n normalisation)."""
    return jnp.sum(jnp.asarray(weights) * jnp.asarray(losses))


def relative_error(estimate, full) -> Float[Array, ""]:
    """``|estimate − full| / |full|``."""
    return jnp.abs(estimate - full) / jnp.abs(full)


def synthetic_lowrank_losses(
    key: jax.Array, n: int = 20_000, d: int = 64, rank: int = 8, *, noise: float = 0.05,
    outlier_frac: float = 0.03, outlier_scale: float = 1.5, lipschitz: float = 0.5,
    link: str = "softplus",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A test instance satisfying the residual-Lipschitz assumption (spec §7).

    ``a_i = B z_i + noise·ε_i`` (orthonormal ``B[d, rank]``, ``z ~ N(0, diag(3…1)²)``), a fraction
    of rows pushed off the subspace by ``outlier_scale·N(0, I)``; loss
    ``ℓ_i = softplus(wᵀz_i/3) + λ r_i^{true}`` with ``r^{true}`` the squared distance to span B;
    ``link="linear"`` uses ``wᵀz_i/3 + offset`` (offset makes the minimum 1), so a linear proxy is
    exact and ``|ℓ_i − ĥ_i| ≤ λ r_i`` holds.

    Returns:
        ``(A [n, d], losses [n], r_true [n])`` as float32 numpy arrays.
    """
    kb, kz, kn, ko, km, kw = jax.random.split(key, 6)
    basis, _ = jnp.linalg.qr(jax.random.normal(kb, (d, rank)))
    z = jax.random.normal(kz, (n, rank)) * jnp.linspace(3.0, 1.0, rank)
    off = noise * jax.random.normal(kn, (n, d))
    outlier = jax.random.uniform(km, (n,)) < outlier_frac
    off = off + outlier[:, None] * outlier_scale * jax.random.normal(ko, (n, d))
    off = off - (off @ basis) @ basis.T  # keep z exact: off-subspace part only
    A = z @ basis.T + off
    r_true = jnp.sum(off * off, axis=1)
    w = jax.random.normal(kw, (rank,))
    if link == "softplus":
        inner = jax.nn.softplus(z @ w / 3.0)
    elif link == "linear":
        inner = z @ w / 3.0
        inner = inner - jnp.min(inner) + 1.0
    else:
        raise ValueError(f"link={link!r} must be 'softplus' or 'linear'.")
    losses = inner + lipschitz * r_true
    return (np.asarray(A, np.float32), np.asarray(losses, np.float32),
            np.asarray(r_true, np.float32))


def weighted_batches(chunks, probs, steps: int, batch_size: int, seed: int = 0):
    """``step -> (inputs, targets)``: ``batch_size`` token chunks drawn ∝ ``probs`` per step.

    Trains on a selected subset as its weights say (e.g. a coreset's ``w / w.sum()``). All
    ``steps`` draws (with replacement) come up front from ``np.random.default_rng(seed)``, so a
    step's batch does not depend on the call order; chunks are cut to the shortest one, inputs
    are ``chunk[:-1]`` and targets ``chunk[1:]`` (the :func:`lowrank_jax.train.finetune.finetune`
    batch function).

    Example::

        >>> batch_of = weighted_batches([[1, 2, 3], [7, 8, 9, 10]], [0.0, 1.0], steps=2,
        ...                             batch_size=1)
        >>> [a.tolist() for a in batch_of(1)]
        [[[7, 8]], [[8, 9]]]
    """
    length = min(len(c) for c in chunks)
    data = np.asarray([c[:length] for c in chunks], np.int32)
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(data), size=batch_size, p=probs) for _ in range(steps)]
    return lambda step: (data[picks[step], :-1], data[picks[step], 1:])


__all__ = [
    "Coreset", "LowRankFit", "chunk_tokens", "compact", "fit_proxy", "kmeans",
    "kmeans_sensitivity_coreset", "lowrank_coreset", "lowrank_residuals",
    "lowrank_residuals_chunked", "relative_error", "sample_coreset", "select_representatives",
    "select_subset", "sensitivity_probs", "synthetic_lowrank_losses", "text_embeddings",
    "uniform_coreset", "weighted_batches", "weighted_mean",
]
