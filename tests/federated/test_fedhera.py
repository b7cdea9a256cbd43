"""FedHera rules: the push, water-filling, prefix gating, unbiased aggregation, ATW, alignment."""

import itertools

import numpy as np
import optax
import pytest

from lowrank_jax.federated import fedhera as hera
from lowrank_jax.federated.simulator import AdapterModel, make_local_train
from lowrank_jax.federated.tasks import topic_model


def _matrix(seed, shape=(12, 9), rank=None):
    rng = np.random.default_rng(seed)
    if rank is None:
        return rng.normal(size=shape).astype(np.float32)
    return (rng.normal(size=(shape[0], rank)) @ rng.normal(size=(rank, shape[1]))).astype(
        np.float32)


@pytest.mark.parametrize("scaling", [1.0, 16.0 / 4, 16.0 / 2.0**0.5])
def test_push_rebuilds_the_truncated_svd(scaling):
    w = _matrix(0)
    u, s, vh = np.linalg.svd(w, full_matrices=False)
    for rank in (1, 4, 9):
        a, b = hera.make_push(u, s, vh, rank, scaling)
        assert a.shape == (12, rank) and b.shape == (rank, 9)
        truncated = (u[:, :rank] * s[:rank]) @ vh[:rank]
        np.testing.assert_allclose(scaling * a @ b, truncated, atol=1e-5)
    np.testing.assert_allclose(scaling * a @ b, w, atol=1e-5)  # full rank: exact
    a, b = hera.make_push(u, s, vh, 3, scaling, pad_to=6)
    assert a.shape == (12, 6) and not a[:, 3:].any() and not b[3:].any()
    with pytest.raises(ValueError, match="rank=10"):
        hera.make_push(u, s, vh, 10, scaling)


def _sigmas():
    rng = np.random.default_rng(1)
    return {f"l{i}": np.sort(rng.random(8))[::-1] * (i + 1) for i in range(4)}


def test_water_fill_download_properties():
    sigmas = _sigmas()
    costs = {"l0": 3.0, "l1": 5.0, "l2": 2.0, "l3": 7.0}
    previous = {k: 0 for k in sigmas}
    for budget in (0.0, 4.0, 11.0, 30.0, 60.0, 1000.0):
        ranks = hera.water_fill_download(sigmas, costs, budget)
        assert sum(ranks[k] * costs[k] for k in ranks) <= budget
        assert all(ranks[k] >= previous[k] for k in ranks)  # monotone in the budget
        previous = ranks
    assert hera.water_fill_download(sigmas, costs, 0.0) == {k: 0 for k in sigmas}
    assert previous == {k: 8 for k in sigmas}
    # equal costs: the global top-k singular values, k = floor(budget / cost)
    equal = {k: 2.0 for k in sigmas}
    ranks = hera.water_fill_download(sigmas, equal, 2.0 * 11 + 1.0)
    pooled = sorted(((s, k) for k, v in sigmas.items() for s in v), reverse=True)[:11]
    expected = {k: sum(1 for _, kk in pooled if kk == k) for k in sigmas}
    assert ranks == expected
    capped = hera.water_fill_download(sigmas, equal, 1000.0, max_rank={k: 3 for k in sigmas})
    assert capped == {k: 3 for k in sigmas}


def test_water_fill_train_respects_budgets_and_reduces_to_energy_per_memory():
    sigmas = _sigmas()
    total = {"l0": 8, "l1": 2, "l2": 5, "l3": 0}
    memory = {"l0": 3.0, "l1": 5.0, "l2": 2.0, "l3": 7.0}
    time = {"l0": 0.5, "l1": 0.1, "l2": 0.9, "l3": 0.2}
    for m_budget, t_budget in ((10.0, 1.0), (25.0, 4.0), (100.0, 100.0)):
        ranks = hera.water_fill_train(sigmas, total, memory, time, m_budget, t_budget)
        assert all(ranks[k] <= total[k] for k in ranks)
        assert sum(ranks[k] * memory[k] for k in ranks) <= m_budget
        assert sum(ranks[k] * time[k] for k in ranks) <= t_budget + 1e-12
    # no time cost and equal memory costs: the top-k energies among the allowed columns
    ranks = hera.water_fill_train(sigmas, total, {k: 1.0 for k in sigmas},
                                  {k: 0.0 for k in sigmas}, 6.0, 1.0)
    allowed = sorted(((s, k) for k, v in sigmas.items() for s in v[: total[k]]), reverse=True)[:6]
    assert ranks == {k: sum(1 for _, kk in allowed if kk == k) for k in sigmas}


def test_prefix_gating_keeps_the_tail_bit_for_bit():
    model = topic_model(features=8, hidden=6, classes=3, depth=2, rank=4, seed=0)
    adapter_model = AdapterModel(model)
    rng = np.random.default_rng(0)
    adapters = {k: (rng.normal(size=a.shape).astype(np.float32),
                    rng.normal(size=b.shape).astype(np.float32))
                for k, (a, b) in adapter_model.initial_adapters().items()}
    train_rank = 2
    mask_a, mask_b = hera.prefix_mask(train_rank, 4)
    assert mask_a.shape == (1, 4) and mask_b.shape == (4, 1)
    masks = {k: mask_a[0] for k in adapters}
    train = make_local_train(adapter_model, optax.adamw(1e-2, weight_decay=0.1))
    xs = rng.normal(size=(5, 7, 8)).astype(np.float32)
    ys = rng.integers(0, 3, size=(5, 7)).astype(np.int32)
    trained, _ = train(adapters, masks, xs, ys)
    for k, (a, b) in adapters.items():
        new_a, new_b = np.asarray(trained[k][0]), np.asarray(trained[k][1])
        assert np.array_equal(new_a[:, train_rank:], a[:, train_rank:])
        assert np.array_equal(new_b[train_rank:], b[train_rank:])
        assert not np.allclose(new_a[:, :train_rank], a[:, :train_rank])  # the prefix trains


def _pushes(global_dense, ranks, scaling, pad):
    u, s, vh = np.linalg.svd(global_dense, full_matrices=False)
    pairs = [hera.make_push(u, s, vh, r, scaling, pad_to=pad) for r in ranks]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def test_unbiased_aggregation_is_unbiased_and_the_original_is_not():
    scaling, pad = 2.0, 6
    g = _matrix(3, rank=6)
    weights = np.array([3.0, 1.0, 2.0])
    a0, b0 = _pushes(g, [2, 4, 6], scaling, pad)
    inits = {"w": (a0, b0)}
    # 1) clients return exactly what they received
    unbiased = hera.merge_dense_unbiased({"w": g}, inits, inits, weights, scaling)["w"]
    np.testing.assert_allclose(unbiased, g, atol=1e-5)
    original = hera.merge_dense(inits, weights, scaling)["w"]
    p = weights / weights.sum()
    truncations = np.einsum("n,nij->ij", p, scaling * a0 @ b0)
    np.testing.assert_allclose(original, truncations, atol=1e-5)
    assert np.linalg.norm(original - g) > 0.1 * np.linalg.norm(g)  # biased
    # 2) each client moves its factors by a training step: the unbiased rule adds exactly the
    #    weighted training deltas to the previous global update
    rng = np.random.default_rng(4)
    a1 = a0 + 0.1 * rng.normal(size=a0.shape) * (np.abs(a0).sum(1, keepdims=True) > 0)
    b1 = b0 + 0.1 * rng.normal(size=b0.shape)
    trained = {"w": (a1, b1)}
    deltas = scaling * (a1 @ b1 - a0 @ b0)
    expected = g + np.einsum("n,nij->ij", p, deltas)
    got = hera.merge_dense_unbiased({"w": g}, trained, inits, weights, scaling)["w"]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    # round 0 (no previous update) falls back to the original rule
    np.testing.assert_allclose(
        hera.merge_dense_unbiased(None, trained, inits, weights, scaling)["w"],
                               hera.merge_dense(trained, weights, scaling)["w"], atol=1e-6)
    with pytest.raises(ValueError, match="weights"):
        hera.merge_dense(inits, [1.0, -1.0, 1.0], scaling)


def test_tail_warmup_lambda():
    assert float(hera.atw_lambda(0.0, 0, -1)) == pytest.approx(1 - np.exp(-0.5), abs=1e-9)
    grid = [(s, t, seen) for s in (-1.0, -0.3, 0.0, 0.5, 1.0) for t in range(8)
            for seen in range(-1, t)]
    for s, t, seen in grid:
        assert 0.0 <= float(hera.atw_lambda(s, t, seen)) <= 1.0
    series = [float(hera.atw_lambda(0.0, t, -1)) for t in range(10)]
    assert all(x < y for x, y in itertools.pairwise(series))  # s = 0: increasing in t
    by_s = [float(hera.atw_lambda(s, 2, 1)) for s in (-0.5, 0.0, 0.5, 1.0)]
    assert all(x < y for x, y in itertools.pairwise(by_s))  # increasing in s
    a, b = np.ones((5, 4)), np.ones((4, 3))
    a2, b2 = hera.apply_tail_warmup(a, b, 2, 0.25)
    np.testing.assert_allclose(a2 @ b2, 2 * 1.0 + 2 * 0.25 * np.ones((5, 3)))


def test_factored_alignment_equals_dense_cosine():
    rng = np.random.default_rng(5)
    adapters = {"a": (rng.normal(size=(7, 3)), rng.normal(size=(3, 5))),
                "b": (rng.normal(size=(4, 3)), rng.normal(size=(3, 6)))}
    scaling = {"a": 1.5, "b": 0.5}
    g = {"a": rng.normal(size=(7, 5)), "b": rng.normal(size=(4, 6))}
    d = np.concatenate([(scaling[k] * a @ b).ravel() for k, (a, b) in adapters.items()])
    gg = np.concatenate([g[k].ravel() for k in adapters])
    cosine = d @ gg / np.linalg.norm(d) / np.linalg.norm(gg)
    assert hera.alignment(adapters, g, scaling) == pytest.approx(cosine, abs=1e-9)
    same = {k: scaling[k] * a @ b for k, (a, b) in adapters.items()}
    assert hera.alignment(adapters, same, scaling) == pytest.approx(1.0, abs=1e-9)
