"""Low-rank residual coresets: unbiasedness, residual algebra, the stated error bound."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.data import selection as sel


@functools.cache
def _instance(link="linear", n=4000):
    A, losses, r_true = sel.synthetic_lowrank_losses(jax.random.key(0), n=n, link=link)
    return jnp.asarray(A), jnp.asarray(losses), r_true


def test_unbiased_for_any_positive_p():
    n, m = 50, 8
    losses = jax.random.uniform(jax.random.key(1), (n,), minval=0.1, maxval=3.0)
    p = jax.random.uniform(jax.random.key(2), (n,), minval=0.05, maxval=1.0)
    p = p / p.sum()
    keys = jax.random.split(jax.random.key(3), 2000)

    def estimate(k):
        idx, w = sel.sample_coreset(k, p, m)
        return sel.weighted_mean(losses[idx], w)

    est = jax.jit(jax.vmap(estimate))(keys)
    se = float(jnp.std(est)) / np.sqrt(len(keys))
    assert abs(float(est.mean()) - float(losses.mean())) < 3 * se
    assert float(jnp.std(est)) > 0  # not trivially exact: the test can fail


def test_zero_variance_when_p_proportional_to_loss():
    losses = jax.random.uniform(jax.random.key(4), (40,), minval=0.5, maxval=2.0)
    p = losses / losses.sum()
    for s in range(5):
        idx, w = sel.sample_coreset(jax.random.key(s), p, 16)
        np.testing.assert_allclose(float(sel.weighted_mean(losses[idx], w)),
                                   float(losses.mean()), rtol=1e-6)


def test_exact_residuals_equal_tail_energy_and_are_nonnegative():
    A = jax.random.normal(jax.random.key(5), (60, 12))
    fit = sel.lowrank_residuals(jax.random.key(0), A, 4, method="exact")
    s = np.linalg.svd(np.asarray(A, np.float64), compute_uv=False)
    assert float(fit.resid.min()) >= 0
    np.testing.assert_allclose(float(fit.phi), np.sum(s[4:] ** 2), rtol=1e-5)
    gram = sel.lowrank_residuals(jax.random.key(0), A, 4, method="gram")
    np.testing.assert_allclose(float(gram.phi), np.sum(s[4:] ** 2), rtol=1e-4)


def test_exactly_low_rank_data_has_zero_phi_and_probs_follow_proxy():
    A = (jax.random.normal(jax.random.key(6), (200, 3))
         @ jax.random.normal(jax.random.key(7), (3, 20)))
    fit = sel.lowrank_residuals(jax.random.key(0), A, 3, method="exact")
    assert float(fit.phi) < 1e-4 * float(jnp.sum(A * A))
    proxy = 1.0 + jnp.abs(fit.coords[:, 0])
    p = sel.sensitivity_probs(proxy, fit.resid, 1.0, uniform_mix=0.1)
    expected = 0.9 * proxy / proxy.sum() + 0.1 / 200
    np.testing.assert_allclose(np.asarray(p), np.asarray(expected), rtol=1e-3)


def test_randomized_phi_matches_exact_with_spectral_gap():
    base = jax.random.normal(jax.random.key(8), (300, 5)) * 10.0
    A = base @ jax.random.normal(jax.random.key(9), (5, 40)) + 0.1 * jax.random.normal(
        jax.random.key(10), (300, 40))
    exact = sel.lowrank_residuals(jax.random.key(0), A, 5, method="exact")
    assert float(exact.sing[-1]) >= 10 * float(jnp.linalg.svd(A, compute_uv=False)[5])
    rand = sel.lowrank_residuals(jax.random.key(1), A, 5, method="randomized")
    np.testing.assert_allclose(float(rand.phi), float(exact.phi), rtol=0.01)


@pytest.mark.slow
def test_scaling_invariance():
    A, losses, _ = _instance()
    A = A[:500]
    c = 3.0
    f1 = sel.lowrank_residuals(jax.random.key(0), A, 8, method="exact")
    f2 = sel.lowrank_residuals(jax.random.key(0), c * A, 8, method="exact")
    np.testing.assert_allclose(np.asarray(f2.resid), c ** 2 * np.asarray(f1.resid), rtol=1e-3,
                               atol=1e-4)
    proxy = losses[:500]
    p1 = sel.sensitivity_probs(proxy, f1.resid, 0.5)
    p2 = sel.sensitivity_probs(proxy, f2.resid, 0.5 / c ** 2)
    np.testing.assert_allclose(np.asarray(p2), np.asarray(p1), rtol=1e-3)


def test_weights_positive_bounded_and_average_one():
    p = jax.random.dirichlet(jax.random.key(11), jnp.full((30,), 0.3))
    p = 0.8 * p + 0.2 / 30  # eta = 0.2
    m = 10
    idx, w = sel.sample_coreset(jax.random.key(0), p, m, dedupe=False)
    assert float(w.min()) > 0 and float(w.max()) <= 1 / (m * 0.2) + 1e-6
    totals = jax.jit(jax.vmap(lambda k: sel.sample_coreset(k, p, m)[1].sum()))(
        jax.random.split(jax.random.key(1), 1000))
    assert abs(float(totals.mean()) - 1.0) < 3 * float(totals.std()) / np.sqrt(1000)
    idx, w = sel.sample_coreset(jax.random.key(2), p, m)  # merged: distinct positive slots
    kept, kw = sel.compact(idx, w)
    assert len(np.unique(kept)) == len(kept) and kw.min() > 0


@pytest.mark.parametrize("m", [100, 400])
def test_guarantee_chebyshev_bound(m):
    A, losses, _ = _instance()
    oracle = lambda i: losses[i]
    fit = sel.lowrank_residuals(jax.random.key(0), A, 8)
    lbar = float(losses.mean())

    def run(k):
        cs = sel.lowrank_coreset(k, A, oracle, num_samples=m, rank=8, fit=fit)
        return jnp.abs(sel.weighted_mean(losses[cs.idx], cs.weights) - lbar), cs.lipschitz

    errs, lams = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(7), 100))
    bound = 3 / np.sqrt(m) * (lbar + np.asarray(lams) * float(fit.phi) / A.shape[0])
    np.testing.assert_allclose(np.asarray(lams), 0.5, rtol=0.05)  # λ recovered by the fit
    assert np.mean(np.asarray(errs) <= bound) >= 0.9


def test_power_lowrank_passes_uniform_fails_tight_bound():
    A, losses, _ = _instance("softplus", n=20_000)
    m = 100
    oracle = lambda i: losses[i]
    fit = sel.lowrank_residuals(jax.random.key(0), A, 8, method="exact")
    lbar = float(losses.mean())
    tight = 1 / np.sqrt(m) * (lbar + 0.5 * float(fit.phi) / A.shape[0])
    err = lambda cs: jnp.abs(sel.weighted_mean(losses[cs.idx], cs.weights) - lbar)
    keys = jax.random.split(jax.random.key(8), 40)
    lr_err = jax.jit(jax.vmap(lambda k: err(
        sel.lowrank_coreset(k, A, oracle, num_samples=m, rank=8, fit=fit))))(keys)
    un_err = jax.jit(jax.vmap(lambda k: err(sel.uniform_coreset(k, A.shape[0], m))))(keys)
    assert np.percentile(lr_err, 90) < tight
    assert np.mean(np.asarray(un_err) > tight) > 0.5


@pytest.mark.slow
def test_budget_and_determinism():
    A, losses, _ = _instance()
    calls = []

    def oracle(i):
        calls.append(len(i))
        return losses[i]

    a = sel.lowrank_coreset(jax.random.key(3), A, oracle, num_samples=50, rank=8)
    b = sel.lowrank_coreset(jax.random.key(3), A, oracle, num_samples=50, rank=8)
    np.testing.assert_array_equal(np.asarray(a.idx), np.asarray(b.idx))
    np.testing.assert_array_equal(np.asarray(a.weights), np.asarray(b.weights))
    assert calls == [32, 32]  # only the 4·rank representatives are queried by the library
    kept, _ = sel.compact(a.idx, a.weights)
    assert len(np.unique(kept)) + len(a.rep_idx) <= 50 + 32
    assert len(np.unique(np.asarray(a.rep_idx))) == 32


@pytest.mark.slow
def test_jit_matches_eager():
    A, losses, _ = _instance()
    A = A[:300]
    f_eager = sel.lowrank_residuals(jax.random.key(0), A, 4)
    f_jit = jax.jit(sel.lowrank_residuals, static_argnums=2)(jax.random.key(0), A, 4)
    np.testing.assert_allclose(np.asarray(f_jit.resid), np.asarray(f_eager.resid), rtol=1e-4,
                               atol=1e-4)
    p = jax.jit(sel.sensitivity_probs)(losses[:300], f_jit.resid, 0.5)
    idx, w = jax.jit(sel.sample_coreset, static_argnums=2)(jax.random.key(1), p, 20)
    idx2, w2 = sel.sample_coreset(jax.random.key(1), p, 20)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx2))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w2), rtol=1e-6)


def test_chunked_streaming_matches_in_memory(tmp_path):
    A, _, _ = _instance()
    path = tmp_path / "emb.npy"
    np.save(path, np.asarray(A[:1000]))
    mm = np.load(path, mmap_mode="r")
    chunked = sel.lowrank_residuals_chunked(mm, 8, chunk_rows=128)
    exact = sel.lowrank_residuals(jax.random.key(0), A[:1000], 8, method="exact")
    np.testing.assert_allclose(float(chunked.phi), float(exact.phi), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(chunked.resid), np.asarray(exact.resid), rtol=1e-3,
                               atol=1e-3)
    angular = sel.lowrank_residuals_chunked(mm, 8, chunk_rows=300, normalize_rows=True)
    assert float(angular.resid.max()) <= 1.0 + 1e-5


def test_kmeans_recovers_blobs_and_baseline_is_unbiased():
    centers = jnp.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    labels = jnp.repeat(jnp.arange(3), 100)
    X = centers[labels] + 0.3 * jax.random.normal(jax.random.key(0), (300, 2))
    _, found = sel.kmeans(jax.random.key(1), X, 3)
    # same partition up to relabelling
    pairs = {(int(a), int(b)) for a, b in zip(labels, found)}
    assert len(pairs) == 3
    losses = 1.0 + jnp.abs(X[:, 0]) / 10

    def run(k):
        c = sel.kmeans_sensitivity_coreset(k, X, lambda i: losses[i], num_clusters=3,
                                           num_samples=20, lipschitz=0.1)
        return sel.weighted_mean(losses[c.idx], c.weights)

    est = np.asarray(jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(2), 300)))
    assert abs(est.mean() - float(losses.mean())) < 3 * est.std() / np.sqrt(300) + 1e-6


def test_bad_inputs_raise_clear_errors():
    A = jnp.ones((10, 4))
    with pytest.raises(ValueError, match="rank"):
        sel.lowrank_residuals(jax.random.key(0), A, 5)
    with pytest.raises(ValueError, match="2-D"):
        sel.lowrank_residuals(jax.random.key(0), jnp.ones(10), 1)
    with pytest.raises(ValueError, match="uniform_mix"):
        sel.sensitivity_probs(jnp.ones(10), jnp.ones(10), 1.0, uniform_mix=1.5)
    with pytest.raises(ValueError, match="loss_oracle"):
        sel.lowrank_coreset(jax.random.key(0), jax.random.normal(jax.random.key(1), (40, 6)),
                            lambda i: jnp.ones(3), num_samples=5, rank=2)


def test_text_embeddings_pool_and_loss_ignore_padding():
    from flax import nnx

    from lowrank_jax.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32,
                      max_seq_len=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    short, long = [3, 5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    emb, nll = sel.text_embeddings(model, [short, long], batch_size=2, with_loss=True)
    tokens = jnp.asarray([short])
    hidden, _ = model.hidden_states(tokens)
    np.testing.assert_allclose(emb[0], np.asarray(hidden[0].mean(0)), rtol=1e-4, atol=1e-5)
    logp = jax.nn.log_softmax(model(tokens)[0][0, :-1], axis=-1)
    ref = -float(jnp.mean(logp[jnp.arange(3), jnp.asarray(short[1:])]))
    np.testing.assert_allclose(nll[0], ref, rtol=1e-4)
    assert sel.chunk_tokens(list(range(20)), 8, min_tokens=5) == [list(range(8)),
                                                                  list(range(8, 16))]


def test_select_subset_methods_estimate_the_mean():
    A, losses, _ = _instance()
    lbar = float(losses.mean())
    for method in ("lowrank", "kmeans", "uniform"):
        cs = sel.select_subset(jax.random.key(1), A, 800, losses=losses, method=method, rank=8)
        est = float(sel.weighted_mean(losses[cs.idx], cs.weights))
        assert abs(est - lbar) < 0.15 * lbar, method
    free = sel.select_subset(jax.random.key(1), A, 200, rank=8)  # label-free residual sampling
    fit = sel.lowrank_residuals(jax.random.key(0), A, 8, method="exact")
    expected = 0.9 * (fit.resid.mean() + fit.resid) / (2 * fit.resid.sum()) + 0.1 / A.shape[0]
    np.testing.assert_allclose(np.asarray(free.probs), np.asarray(expected), rtol=2e-2)


def test_cli_select_embeddings(tmp_path):
    from lowrank_jax.cli import main

    A, _, _ = _instance()
    emb, out = tmp_path / "emb.npy", tmp_path / "idx.npy"
    np.save(emb, np.asarray(A[:600]))
    np.save(tmp_path / "loss.npy", np.asarray(_instance()[1][:600]))
    args = ["select", "--embeddings", str(emb), "--budget", "40", "--out", str(out), "--rank", "8"]
    assert main(args + ["--chunk-rows", "256", "--losses", str(tmp_path / "loss.npy")]) == 0
    idx, w = np.load(out), np.load(tmp_path / "idx_weights.npy")
    assert idx.shape == w.shape and len(np.unique(idx)) == len(idx) and idx.max() < 600
    assert w.min() > 0 and 0.3 < w.sum() < 3.0
    assert main(["select", "--embeddings", str(emb), "--budget", "0", "--out", str(out)]) == 2


def test_weighted_batches_draw_by_weight_up_front_and_shift_targets():
    chunks = [[0, 1, 2, 3, 4], [10, 11, 12, 13], [20, 21, 22, 23, 24, 25]]
    probs = [0.5, 0.0, 0.5]
    batch_of = sel.weighted_batches(chunks, probs, steps=3, batch_size=4, seed=5)
    rng = np.random.default_rng(5)  # the same draws, step after step
    expected = [rng.choice(3, size=4, p=probs) for _ in range(3)]
    for step in (2, 0, 1):  # any call order
        x, y = batch_of(step)
        rows = np.asarray([c[:4] for c in chunks])[expected[step]]
        np.testing.assert_array_equal(x, rows[:, :-1])
        np.testing.assert_array_equal(y, rows[:, 1:])
        assert 1 not in expected[step]  # zero weight: never drawn
