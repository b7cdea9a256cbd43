"""FedTreeLoRA: one client-similarity tree, a per-layer cut depth, trunk / branch aggregation.

Pure host-side functions (NumPy) on client-stacked adapters ``{layer: (A [N, d_in, r],
B [N, r, d_out])}``; the server loop is :class:`lowrank_jax.federated.strategies.FedTreeLoRA`.

* distance ``D_ij = mean_l (1 − cos(vec B_i^l, vec B_j^l))`` (B, not A: FedLEASE);
* average-linkage agglomerative tree, merges in the scipy ``linkage`` format ``[N − 1, 4]``,
  ties broken by the lowest cluster index, so the result is deterministic;
* cutting at ``k`` groups gives nested partitions ``P_1 ⊐ … ⊐ P_N``;
* per layer, **DERIVED** rule: ``k_l = min {k : every group of P_k has mean pairwise S^l ≥ τ}``
  (singletons are coherent), optionally made non-decreasing with depth (trunk, then branches);
* each layer's A and B are averaged (``p_i ∝ n_i``) within that layer's groups — A and B with the
  same groups, so ``B·A`` keeps its meaning.

Privacy note: pairwise B similarity reveals which clients share tasks; this module does not
mitigate that.

References:
    Bian et al, `FedTreeLoRA <https://arxiv.org/abs/2603.13282>`_, ICML 2026; Wang et al,
    `FedLEASE <https://arxiv.org/abs/2509.15087>`_, NeurIPS 2025 (B-cosine distance, linkage).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

EPS = 1e-8


def _flat_b(adapters, layer) -> np.ndarray:
    b = np.asarray(adapters[layer][1], dtype=np.float64)
    return b.reshape(b.shape[0], -1)


def layer_similarity(adapters, layer: str) -> np.ndarray:
    """``S^l [N, N]``: cosine similarity of the clients' ``vec B^l``."""
    if layer not in adapters:
        raise ValueError(f"layer={layer!r} is not in the adapters (have {sorted(adapters)[:6]}).")
    b = _flat_b(adapters, layer)
    norms = np.linalg.norm(b, axis=1)
    return (b @ b.T) / (norms[:, None] * norms[None, :] + EPS)


def client_distance(adapters, layers: Sequence[str] | None = None) -> np.ndarray:
    """``D [N, N] = mean_l (1 − S^l)`` over ``layers`` (default: all adapted layers)."""
    layers = list(adapters) if layers is None else list(layers)
    if not layers:
        raise ValueError("client_distance: give at least one layer.")
    d = np.mean([1.0 - layer_similarity(adapters, layer) for layer in layers], axis=0)
    np.fill_diagonal(d, 0.0)
    return d


def build_tree(distance: np.ndarray) -> np.ndarray:
    """Average-linkage agglomerative clustering: merges ``[N − 1, 4]`` (scipy ``linkage`` format:
    child id, child id, distance, size; new clusters get ids ``N, N+1, …``).

    Ties (equal average distance) go to the pair with the smallest ``(min member of the first
    cluster, min member of the second)``, so identical inputs give identical trees.
    """
    d = np.asarray(distance, dtype=np.float64)
    n = d.shape[0]
    if d.ndim != 2 or d.shape != (n, n) or n < 1:
        raise ValueError(f"distance must be a square [N, N] matrix; got shape {d.shape}.")
    clusters = {i: [i] for i in range(n)}
    merges = np.zeros((max(n - 1, 0), 4))
    next_id = n
    for step in range(n - 1):
        ids = sorted(clusters, key=lambda c: min(clusters[c]))
        best, best_key = None, None
        for x, ci in enumerate(ids):
            for cj in ids[x + 1:]:
                avg = float(d[np.ix_(clusters[ci], clusters[cj])].mean())
                key = (round(avg, 12), min(clusters[ci]), min(clusters[cj]))
                if best_key is None or key < best_key:
                    best, best_key = (ci, cj, avg), key
        ci, cj, avg = best
        members = clusters.pop(ci) + clusters.pop(cj)
        merges[step] = (ci, cj, avg, len(members))
        clusters[next_id] = sorted(members)
        next_id += 1
    return merges


def cut(tree: np.ndarray, n_groups: int) -> np.ndarray:
    """Labels ``[N]`` of the partition with ``n_groups`` groups (the first ``N − k`` merges).

    Labels are canonical: group ``g`` is the one whose smallest member is the ``g``-th smallest,
    so permuting the clients permutes the labels consistently.
    """
    n = tree.shape[0] + 1
    if not 1 <= n_groups <= n:
        raise ValueError(f"n_groups={n_groups} must lie in [1, N={n}].")
    clusters = {i: [i] for i in range(n)}
    for step in range(n - n_groups):
        ci, cj = int(tree[step, 0]), int(tree[step, 1])
        clusters[n + step] = clusters.pop(ci) + clusters.pop(cj)
    groups = sorted(clusters.values(), key=min)
    labels = np.empty(n, dtype=np.int32)
    for g, members in enumerate(groups):
        labels[members] = g
    return labels


def _coherent(labels: np.ndarray, similarity: np.ndarray, tau: float) -> bool:
    for g in np.unique(labels):
        members = np.flatnonzero(labels == g)
        if len(members) < 2:
            continue
        block = similarity[np.ix_(members, members)]
        off = (block.sum() - np.trace(block)) / (len(members) * (len(members) - 1))
        if off < tau:
            return False
    return True


def choose_depths(tree: np.ndarray, similarities: Mapping[str, np.ndarray], tau: float = 0.5,
                  *, monotone: bool = True) -> dict:
    """``{layer: k_l}``: the coarsest cut whose groups all have mean pairwise ``S^l ≥ tau``.

    With ``monotone`` the counts never decrease along the layer order of ``similarities``
    (running max): shallow layers share a trunk, deep layers branch.
    """
    n = tree.shape[0] + 1
    partitions = [cut(tree, k) for k in range(1, n + 1)]
    depths, running = {}, 1
    for layer, sim in similarities.items():
        k = next(k for k, labels in enumerate(partitions, start=1)
                 if _coherent(labels, np.asarray(sim), tau))
        if monotone:
            running = max(running, k)
            k = running
        depths[layer] = k
    return depths


def group_average(adapters, weights, labels_per_layer: Mapping[str, np.ndarray]) -> dict:
    """Average A and B (separately, ``p_i ∝ weights``) within each layer's groups; every member
    receives its group's mean. Returns client-stacked adapters of the same shapes."""
    w = np.asarray(weights, dtype=np.float64)
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights must be non-negative with a positive sum (one per client).")
    out = {}
    for layer, (a, b) in adapters.items():
        labels = np.asarray(labels_per_layer[layer])
        a, b = np.asarray(a), np.asarray(b)
        new_a, new_b = a.copy(), b.copy()
        for g in np.unique(labels):
            members = np.flatnonzero(labels == g)
            p = w[members] / max(w[members].sum(), EPS)
            new_a[members] = np.tensordot(p, a[members], axes=1)
            new_b[members] = np.tensordot(p, b[members], axes=1)
        out[layer] = (new_a, new_b)
    return out


def aggregate(adapters, weights, depths: Mapping[str, int], tree: np.ndarray) -> dict:
    """FedTreeLoRA aggregation: layer ``l`` averaged within the groups of ``cut(tree, k_l)``."""
    labels = {layer: cut(tree, int(depths[layer])) for layer in adapters}
    return group_average(adapters, weights, labels)


def tree_report(state: Mapping, labels: Sequence[str], layers: Sequence[str]) -> dict:
    """How well the tree of a FedTreeLoRA run finds known client groups (e.g. data domains).

    Args:
        state: the strategy's server state (``tree`` ``[≥ N − 1, 4]``, ``depths`` per layer,
            ``built``: the round the tree was built).
        labels: each client's true group name.
        layers: the adapted layer names, in the order of ``state["depths"]``.

    Returns:
        ``tree`` (the merges), ``cut_groups`` (the groups' names of the cut at the number of true
        groups), ``cut_is_domains`` (that cut is exactly the true groups), ``pairs`` /
        ``same_domain_pairs`` (first merges of two single clients, and how many join one group),
        ``depths`` (``{layer: k_l}``) and ``built_round``.

    Example::

        >>> tree = np.array([[0, 1, 0.1, 2], [2, 3, 0.2, 2], [4, 5, 0.9, 4]])
        >>> report = tree_report({"tree": tree, "depths": [2], "built": 1}, ["a", "a", "b", "b"],
        ...                      ["q"])
        >>> report["cut_groups"], report["cut_is_domains"], report["same_domain_pairs"]
        ([['a'], ['b']], True, 2)
    """
    n = len(labels)
    tree = np.asarray(state["tree"])[: n - 1]
    domains = sorted(set(labels))
    groups_of = cut(tree, len(domains))
    groups = [sorted({labels[i] for i in np.flatnonzero(groups_of == g)})
              for g in np.unique(groups_of)]
    pure = all(len(g) == 1 for g in groups) and len(groups) == len(domains)
    first_pairs = [(int(a), int(b)) for a, b, _, size in tree if size == 2]
    same = sum(labels[a] == labels[b] for a, b in first_pairs)
    return {"tree": tree.tolist(), "cut_groups": groups, "cut_is_domains": bool(pure),
            "pairs": len(first_pairs), "same_domain_pairs": int(same),
            "depths": {layer: int(k) for layer, k in zip(layers, state["depths"])},
            "built_round": int(state["built"])}
