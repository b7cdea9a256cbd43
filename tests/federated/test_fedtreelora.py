"""FedTreeLoRA rules: the tree, its cuts, per-layer depths, group aggregation, determinism."""

import numpy as np
import pytest

from lowrank_jax.federated import fedtreelora as tree


def _block_distance(sizes=(3, 4), near=0.1, far=0.9, seed=0):
    n = sum(sizes)
    blocks = np.repeat(np.arange(len(sizes)), sizes)
    rng = np.random.default_rng(seed)
    noise = rng.uniform(0, 0.05, (n, n))
    d = np.where(blocks[:, None] == blocks[None, :], near, far) + (noise + noise.T) / 2
    np.fill_diagonal(d, 0.0)
    return d, blocks


def test_tree_merges_within_blocks_first_and_cut_recovers_them():
    d, blocks = _block_distance()
    merges = tree.build_tree(d)
    assert merges.shape == (6, 4)
    assert np.all(np.diff(merges[:, 2]) >= -1e-12)  # average linkage: monotone heights
    assert merges[-1, 3] == 7 and merges[-1, 2] > 0.8  # the last merge joins the blocks
    np.testing.assert_array_equal(tree.cut(merges, 2), blocks)
    np.testing.assert_array_equal(tree.cut(merges, 1), np.zeros(7))
    np.testing.assert_array_equal(tree.cut(merges, 7), np.arange(7))
    with pytest.raises(ValueError, match="n_groups"):
        tree.cut(merges, 8)


def test_partitions_are_nested():
    d = np.abs(np.random.default_rng(1).normal(size=(9, 9)))
    d = (d + d.T) / 2
    np.fill_diagonal(d, 0)
    merges = tree.build_tree(d)
    for k in range(1, 9):
        coarse, fine = tree.cut(merges, k), tree.cut(merges, k + 1)
        for g in np.unique(fine):
            assert len(np.unique(coarse[fine == g])) == 1


def test_ties_break_deterministically_by_lowest_index():
    d = np.ones((5, 5)) - np.eye(5)  # every pair at the same distance
    first, second = tree.build_tree(d), tree.build_tree(d.copy())
    np.testing.assert_array_equal(first, second)
    assert tuple(first[0, :2]) == (0, 1)  # lowest indices merge first
    np.testing.assert_array_equal(tree.cut(first, 4), [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(tree.cut(first, 3), [0, 0, 0, 1, 2])


def test_permuting_clients_permutes_labels_consistently():
    d, _ = _block_distance(sizes=(2, 3, 3), seed=2)
    perm = np.random.default_rng(3).permutation(len(d))
    for k in (2, 3, 5):
        labels = tree.cut(tree.build_tree(d), k)
        permuted = tree.cut(tree.build_tree(d[np.ix_(perm, perm)]), k)
        # same partition: clients i, j grouped together iff perm-images are
        same = labels[:, None] == labels[None, :]
        same_p = permuted[:, None] == permuted[None, :]
        np.testing.assert_array_equal(same[np.ix_(perm, perm)], same_p)


def _adapters(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return {f"l{i}": (rng.normal(size=(n, 5, 2)), rng.normal(size=(n, 2, 4))) for i in range(3)}


def test_aggregate_extremes_and_group_means():
    adapters = _adapters()
    w = np.array([1.0, 2.0, 3.0, 1.0, 1.0, 2.0])
    merges = tree.build_tree(tree.client_distance(adapters))
    fedavg = tree.aggregate(adapters, w, {k: 1 for k in adapters}, merges)
    local = tree.aggregate(adapters, w, {k: 6 for k in adapters}, merges)
    for k, (a, b) in adapters.items():
        p = w / w.sum()
        np.testing.assert_allclose(fedavg[k][0], np.broadcast_to(np.tensordot(p, a, 1), a.shape))
        np.testing.assert_allclose(fedavg[k][1], np.broadcast_to(np.tensordot(p, b, 1), b.shape))
        np.testing.assert_array_equal(local[k][0], a)
    k3 = tree.aggregate(adapters, w, {k: 3 for k in adapters}, merges)
    labels = tree.cut(merges, 3)
    for k, (a, _) in adapters.items():
        for g in range(3):
            m = labels == g
            np.testing.assert_allclose(k3[k][0][m].mean(0), np.average(a[m], 0, w[m]), atol=1e-12)
            np.testing.assert_allclose(np.average(k3[k][0][m], 0, w[m]),
                                       np.average(a[m], 0, w[m]), atol=1e-12)
    # a group of identical clients is a fixed point
    same = {k: (np.repeat(a[:1], 6, 0), np.repeat(b[:1], 6, 0)) for k, (a, b) in adapters.items()}
    again = tree.aggregate(same, w, {k: 1 for k in same}, merges)
    for k in same:
        np.testing.assert_allclose(again[k][0], same[k][0], atol=1e-12)


def test_choose_depths():
    n = 6
    identical = {f"l{i}": np.ones((n, n)) for i in range(3)}
    merges = tree.build_tree(np.ones((n, n)) - np.eye(n))
    assert tree.choose_depths(merges, identical) == {"l0": 1, "l1": 1, "l2": 1}
    two_groups = np.kron(np.eye(2), np.ones((3, 3)))  # groups {0,1,2}, {3,4,5}
    d = 1.0 - two_groups
    merges = tree.build_tree(d)
    sims = {"l0": np.ones((n, n)), "l1": two_groups, "l2": np.eye(n)}
    assert tree.choose_depths(merges, sims) == {"l0": 1, "l1": 2, "l2": 6}
    # monotone: a shallow-branching layer forces every deeper layer to branch at least as much
    sims = {"l0": np.eye(n), "l1": np.ones((n, n)), "l2": two_groups}
    assert tree.choose_depths(merges, sims, monotone=True) == {"l0": 6, "l1": 6, "l2": 6}
    assert tree.choose_depths(merges, sims, monotone=False) == {"l0": 6, "l1": 1, "l2": 2}


def test_distance_uses_b_cosine():
    adapters = _adapters(n=3)
    for a, b in adapters.values():
        b[1] = 2.5 * b[0]  # same direction as client 0
        a[1] = -a[0]  # A is ignored
    d = tree.client_distance(adapters)
    assert d[0, 1] == pytest.approx(0.0, abs=1e-9)
    assert d[0, 2] > 0.1
    np.testing.assert_allclose(d, d.T)
