"""FedHera: decoupled download / train ranks for heterogeneous federated LoRA (pure rules).

Every function here is a pure host-side (NumPy) function of per-layer matrices; the server loop
that uses them is
:class:`lowrank_jax.federated.strategies.FedHera`. Layout follows the library (``nnx`` / qwix):
an adapter is ``A [d_in, r]``, ``B [r, d_out]`` and its dense update is
``ΔW = s · A B`` (``[d_in, d_out]``, ``s`` the layer's LoRA scale, ``alpha / rank`` by default).
Client-stacked adapters carry a leading client axis: ``A [N, d_in, r]``, ``B [N, r, d_out]``.

The rules (spec ``fedhera.md``):

* aggregate the clients' dense products, optionally in the unbiased delta form
  ``ΔW_g^t = ΔW_g^{t-1} + Σ_i p_i (D_i − D_i^{init})``;
* take the thin SVD ``ΔW_g = U S Vᵀ``;
* per client, pick the download rank ``r_tot`` per layer by spectrum-preserving water-filling
  under its bandwidth budget, and the trained prefix ``r_main ≤ r_tot`` under its memory and time
  budgets;
* push the top ``r_tot`` directions with the scale folded in (``s · A B`` = the rank-``r_tot``
  truncated SVD), train only the first ``r_main`` (prefix gating), and warm the frozen tail up by
  ``λ`` (Adaptive Tail Warm-up).

References:
    FedHera (ICML 2026), code ``shock-xiaoke/FedHera``; Bai et al, `FlexLoRA
    <https://arxiv.org/abs/2402.11505>`_, 2024 (the SVD-redistribution baseline).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

import numpy as np
from jaxtyping import ArrayLike as Array
from jaxtyping import Float

Adapters = Mapping[str, tuple]  # {layer: (A [.., d_in, r], B [.., r, d_out])}

# Cost constants of the reference code, per rank column of a layer with d_in + d_out entries.
MEMORY_BYTES_PER_ENTRY = 2 * 3.5  # fp16 weights + optimizer state + activations, code constant
TIME_MS_PER_ENTRY = 1.7e-4


def _layer_scale(scaling, layer: str) -> float:
    if isinstance(scaling, Mapping):
        if layer not in scaling:
            raise ValueError(f"scaling has no entry for layer {layer!r}; give one per layer.")
        return float(scaling[layer])
    return float(scaling)


def _check_weights(weights, n: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"weights must be {n} non-negative numbers with a positive sum (one per client, "
            f"usually n_i); got shape {w.shape}."
        )
    return w / w.sum()


def dense_update(a: Float[Array, "... d_in r"], b: Float[Array, "... r d_out"], scaling: float):
    """``s · A B`` (batched over leading axes)."""
    return scaling * np.matmul(np.asarray(a), np.asarray(b))


def merge_dense(client_adapters: Adapters, weights, scaling) -> dict:
    """Original FedHera aggregation: ``ΔW_g = Σ_i p_i s A_i B_i`` per layer.

    Args:
        client_adapters: ``{layer: (A [N, d_in, r], B [N, r, d_out])}``.
        weights: ``[N]`` client weights (``n_i``); normalised here.
        scaling: the LoRA scale ``s`` (a float, or ``{layer: float}``).

    Returns:
        ``{layer: ΔW_g [d_in, d_out]}``.
    """
    out = {}
    for layer, (a, b) in client_adapters.items():
        p = _check_weights(weights, np.shape(a)[0])
        dense = dense_update(np.asarray(a, np.float64), np.asarray(b, np.float64),
                             _layer_scale(scaling, layer))
        out[layer] = np.tensordot(p, dense, axes=1).astype(np.float32)
    return out


def merge_dense_unbiased(prev_dense, client_adapters: Adapters, client_inits: Adapters,
                         weights, scaling) -> dict:
    """Unbiased ("paper-style") aggregation: ``ΔW_g^t = ΔW_g^{t-1} + Σ_i p_i (D_i − D_i^{init})``.

    ``D_i^{init}`` is the dense product of what client ``i`` started its local training from (its
    last push). If every client returns exactly what it received, the global update is unchanged,
    whereas :func:`merge_dense` would return the weighted truncations (biased). With
    ``prev_dense=None`` (round 0) this falls back to :func:`merge_dense`.
    """
    if prev_dense is None:
        return merge_dense(client_adapters, weights, scaling)
    out = {}
    for layer, (a, b) in client_adapters.items():
        a0, b0 = client_inits[layer]
        s = _layer_scale(scaling, layer)
        p = _check_weights(weights, np.shape(a)[0])
        f64 = lambda m: np.asarray(m, np.float64)
        delta = dense_update(f64(a), f64(b), s) - dense_update(f64(a0), f64(b0), s)
        out[layer] = (f64(prev_dense[layer]) + np.tensordot(p, delta, axes=1)).astype(np.float32)
    return out


def svd_layers(dense: Mapping[str, Array]) -> dict:
    """Thin float32 SVD per layer: ``{layer: (U [d_in, k], S [k], Vh [k, d_out])}``.

    On a machine whose cores are shared, run with ``OPENBLAS_NUM_THREADS=1``: a threaded
    OpenBLAS SVD of a 512 × 64 matrix was measured 100-1000× slower under contention.
    """
    return {k: tuple(np.linalg.svd(np.asarray(v, np.float32), full_matrices=False))
            for k, v in dense.items()}


def rank_costs(shapes: Mapping[str, tuple[int, int]], bytes_per_element: float = 2.0):
    """Per-rank-column costs of each layer ``(d_in, d_out)``: ``(bytes, memory, time_ms)`` dicts.

    One rank column moves ``d_in + d_out`` numbers: ``bytes = (d_in + d_out) · bytes_per_element``
    (fp16 = 2), ``memory = (d_in + d_out) · 2 · 3.5``, ``time = (d_in + d_out) · 1.7e-4`` ms
    (the reference code's constants).
    """
    entries = {k: float(d_in + d_out) for k, (d_in, d_out) in shapes.items()}
    return ({k: e * bytes_per_element for k, e in entries.items()},
            {k: e * MEMORY_BYTES_PER_ENTRY for k, e in entries.items()},
            {k: e * TIME_MS_PER_ENTRY for k, e in entries.items()})


def _energies(sigmas) -> dict:
    return {k: np.asarray(s, dtype=np.float64) ** 2 for k, s in sigmas.items()}


def water_fill_download(sigmas: Mapping[str, Array], cost_per_rank: Mapping[str, float],
                        budget: float, *, max_rank: Mapping[str, int] | None = None) -> dict:
    """Spectrum-preserving download ranks: greedy energy per byte under a bandwidth budget.

    Starting from ``r_tot = 0``, repeatedly add the next singular direction of the layer with the
    largest ``S_l[r_l]² / c_l`` among the layers whose next column still fits the budget (ties:
    the first layer in ``sigmas`` order). Singular values are sorted, so this is the greedy
    fractional-knapsack rule on spectral energy per byte.

    Args:
        sigmas: ``{layer: S}`` sorted singular values of the global update.
        cost_per_rank: ``{layer: bytes}`` per rank column (:func:`rank_costs`).
        budget: total bytes the client may download.
        max_rank: optional per-layer cap (e.g. the adapter's padded rank).

    Returns:
        ``{layer: r_tot}`` (ints, possibly 0).
    """
    if budget < 0:
        raise ValueError(f"budget={budget} must be >= 0 (bytes).")
    energy = _energies(sigmas)
    order = {k: i for i, k in enumerate(sigmas)}
    cap = {k: len(e) if max_rank is None else min(len(e), int(max_rank[k]))
           for k, e in energy.items()}
    ranks = {k: 0 for k in sigmas}
    used = 0.0
    heap = [(-energy[k][0] / cost_per_rank[k], order[k], k) for k in sigmas if cap[k] > 0]
    heapq.heapify(heap)
    skipped = []
    while heap:
        _, _, k = heapq.heappop(heap)
        if used + cost_per_rank[k] > budget:
            skipped.append(k)  # does not fit now, and costs only grow: drop it
            continue
        used += cost_per_rank[k]
        ranks[k] += 1
        if ranks[k] < cap[k]:
            heapq.heappush(heap, (-energy[k][ranks[k]] / cost_per_rank[k], order[k], k))
    return ranks


def water_fill_train(sigmas: Mapping[str, Array], total_ranks: Mapping[str, int],
                     memory_cost: Mapping[str, float], time_cost: Mapping[str, float],
                     memory_budget: float, time_budget: float) -> dict:
    """Trained ranks ``r_main ≤ r_tot``: greedy energy per blended memory/time cost.

    Each step weighs the scarcer resource more, ``a = inv_T / (inv_T + inv_M)``, ``b = 1 − a``
    with ``inv_T = T_budget / T_left`` and ``inv_M = M_budget / M_left``, and adds the column
    maximising ``S_l[r_l]² / (a·c_t + b·c_m)`` among those that fit both remaining budgets.

    Returns:
        ``{layer: r_main}``.
    """
    if memory_budget < 0 or time_budget < 0:
        raise ValueError(f"memory_budget={memory_budget} and time_budget={time_budget} must be "
                         ">= 0.")
    energy = _energies(sigmas)
    ranks = {k: 0 for k in sigmas}
    mem_left, time_left = float(memory_budget), float(time_budget)
    tiny = 1e-12
    while True:
        inv_t = time_budget / max(time_left, tiny)
        inv_m = memory_budget / max(mem_left, tiny)
        a = inv_t / (inv_t + inv_m) if inv_t + inv_m > 0 else 0.5
        b = 1.0 - a
        best, best_gain = None, -math.inf
        for k in sigmas:
            r = ranks[k]
            if r >= min(int(total_ranks[k]), len(energy[k])):
                continue
            if memory_cost[k] > mem_left or time_cost[k] > time_left:
                continue
            gain = energy[k][r] / (a * time_cost[k] + b * memory_cost[k])
            if gain > best_gain:
                best, best_gain = k, gain
        if best is None:
            return ranks
        ranks[best] += 1
        mem_left -= memory_cost[best]
        time_left -= time_cost[best]


def make_push(u: Float[Array, "d_in k"], s: Float[Array, " k"], vh: Float[Array, "k d_out"],
              rank: int, scaling: float, *, pad_to: int | None = None):
    """Factors of the rank-``rank`` truncated SVD with the LoRA scale folded in.

    With ``ŝ = S[:r] / scaling``: ``A = U[:, :r] · diag(√ŝ)``, ``B = diag(√ŝ) · Vh[:r]``, so
    ``scaling · A B = U_r S_r V_rᵀ`` (the best rank-``r`` approximation). ``pad_to`` appends zero
    columns / rows up to the adapter's stored rank (zero components get zero gradients, so they
    stay zero under training).

    Returns:
        ``(A [d_in, pad_to or r], B [pad_to or r, d_out])``.
    """
    u, s, vh = np.asarray(u), np.asarray(s), np.asarray(vh)
    k = s.shape[0]
    pad = rank if pad_to is None else int(pad_to)
    if not 0 <= rank <= min(k, pad):
        raise ValueError(f"rank={rank} must lie in [0, min(len(S)={k}, pad_to={pad})].")
    if scaling <= 0:
        raise ValueError(f"scaling={scaling} must be > 0 (the LoRA scale alpha/rank).")
    root = np.sqrt(np.maximum(s[:rank], 0.0) / scaling)
    a = u[:, :rank] * root[None, :]
    b = root[:, None] * vh[:rank]
    a = np.pad(a, ((0, 0), (0, pad - rank)))
    b = np.pad(b, ((0, pad - rank), (0, 0)))
    return a, b


def prefix_mask(train_rank: int, stored_rank: int):
    """Gradient masks for prefix gating: ``(mask_A [1, r], mask_B [r, 1])`` with ones on the first
    ``train_rank`` components. Multiply the gradients (or updates) by them; the tail then never
    moves under Adam (zero moments) or SGD. With decoupled weight decay, mask the decay too."""
    if not 0 <= train_rank <= stored_rank:
        raise ValueError(f"train_rank={train_rank} must lie in [0, stored_rank={stored_rank}].")
    keep = (np.arange(stored_rank) < train_rank).astype(np.float32)
    return keep[None, :], keep[:, None]


def atw_lambda(alignment, round_index, last_seen_round, *, temperature: float = 2.0,
               beta: float = 0.9):
    """Adaptive Tail Warm-up: ``λ = clip(1 − exp(−(1 + s·β^{t − t̂}) · (t+1)/T), 0, 1)``.

    ``s`` is the client's last alignment with the global update (0 if unseen, ``t̂ = −1``).
    At ``t = 0``, ``s = 0``: ``λ = 1 − e^{−0.5} ≈ 0.393``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0.")
    s = np.asarray(alignment, np.float64)
    t = np.asarray(round_index, np.float64)
    decay = beta ** (t - np.asarray(last_seen_round, np.float64))
    return np.clip(1.0 - np.exp(-(1.0 + s * decay) * (t + 1.0) / temperature), 0.0, 1.0)


def alignment(adapters: Adapters, global_dense: Mapping[str, Array], scaling) -> float:
    """Cosine between one client's dense update and ``ΔW_g``, over all layers, in factored form.

    ``⟨D, G⟩ = s · Σ A ⊙ (G Bᵀ)`` and ``‖D‖² = s² · Σ (AᵀA) ⊙ (B Bᵀ)``: no ``d_in × d_out`` product
    is formed for the client side.
    """
    inner, norm_d, norm_g = 0.0, 0.0, 0.0
    for layer, (a, b) in adapters.items():
        s = _layer_scale(scaling, layer)
        a, b, g = (np.asarray(m, np.float64) for m in (a, b, global_dense[layer]))
        inner = inner + s * np.sum(a * (g @ b.T))
        norm_d = norm_d + s * s * np.sum((a.T @ a) * (b @ b.T))
        norm_g = norm_g + np.sum(g * g)
    return float(inner / (np.sqrt(max(norm_d, 0.0) * norm_g) + 1e-12))


def apply_tail_warmup(a: Array, b: Array, train_rank: int, lam) -> tuple[Array, Array]:
    """Scale the frozen tail (components ``≥ train_rank``) of both factors by ``√λ``, so its
    contribution to ``A B`` is scaled by ``λ``."""
    a, b = np.asarray(a), np.asarray(b)
    r = a.shape[-1]
    scale = np.where(np.arange(r) < train_rank, 1.0, np.sqrt(lam)).astype(a.dtype)
    return a * scale[None, :], b * scale[:, None]
