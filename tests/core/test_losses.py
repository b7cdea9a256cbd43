"""core.losses: known answers of the one token NLL, cross entropy and sliding-window plan."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.core.losses import (
    cross_entropy,
    sliding_windows,
    token_logprob,
    token_nll,
    window_nll_sum,
    windowed_perplexity,
)


def test_uniform_logits_give_log_vocab():
    nll = token_nll(jnp.zeros((2, 3, 7)), jnp.array([[0, 3, 6], [1, 2, 5]]))
    np.testing.assert_allclose(np.asarray(nll), math.log(7), rtol=1e-6)
    assert nll.dtype == jnp.float32
    assert float(cross_entropy(jnp.zeros((2, 3, 7), jnp.bfloat16), jnp.zeros((2, 3), int))) == \
        pytest.approx(math.log(7), rel=1e-6)


def test_confident_one_hot_logits_give_zero_and_wrong_give_the_margin():
    targets = jnp.array([2, 0, 4])
    logits = 50.0 * jax.nn.one_hot(targets, 5)
    assert float(jnp.max(token_nll(logits, targets))) < 1e-12
    wrong = token_nll(logits, (targets + 1) % 5)  # -log(e^0 / (e^50 + 4)) ~ 50
    np.testing.assert_allclose(np.asarray(wrong), 50.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(token_logprob(logits, targets)), 0.0, atol=1e-12)


def test_matches_a_softmax_written_out():
    logits = jax.random.normal(jax.random.key(0), (4, 9))
    targets = jnp.array([0, 8, 3, 3])
    p = np.exp(np.asarray(logits, np.float64))
    p /= p.sum(-1, keepdims=True)
    want = -np.log(p[np.arange(4), np.asarray(targets)])
    np.testing.assert_allclose(np.asarray(token_nll(logits, targets)), want, rtol=1e-5)
    np.testing.assert_allclose(float(cross_entropy(logits, targets)), want.mean(), rtol=1e-5)


def test_masked_positions_are_ignored():
    logits = jax.random.normal(jax.random.key(1), (2, 5, 6))
    targets = jax.random.randint(jax.random.key(2), (2, 5), 0, 6)
    mask = jnp.array([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]], jnp.float32)
    got = float(cross_entropy(logits, targets, mask))
    nll = np.asarray(token_nll(logits, targets))
    assert got == pytest.approx(nll[np.asarray(mask) > 0].mean(), rel=1e-6)
    # garbage where the mask is 0 changes nothing; an all-zero mask gives 0, not NaN
    noisy = logits.at[0, 2].set(1e4).at[1, 4].set(-1e4)
    assert float(cross_entropy(noisy, targets, mask.astype(bool))) == pytest.approx(got, rel=1e-6)
    assert float(cross_entropy(logits, targets, jnp.zeros((2, 5)))) == 0.0


def test_sliding_windows_score_each_token_at_most_once_with_context():
    for n, window, stride in [(20, 8, None), (20, 8, 3), (5, 8, None), (17, 4, 4), (9, 9, 1)]:
        plan = sliding_windows(n, window, stride)
        scored = [b + r for b, e, lo in plan for r in range(lo, e - b)]
        assert len(scored) == len(set(scored)) and all(lo >= 1 for _, _, lo in plan)
        assert all(e - b == min(window, n) for b, e, _ in plan)
        # only window starts go unscored (no context); overlapping windows skip token 0 only
        skipped = set(range(n)) - set(scored)
        assert 0 in skipped and skipped <= {b for b, _, _ in plan}, (n, window, stride)
        if (stride or window) < window:
            assert skipped == {0}
    assert sliding_windows(20, 8) == [(0, 8, 1), (8, 16, 1), (12, 20, 4)]
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(20, 8, 9)
    with pytest.raises(ValueError, match="at least 2"):
        sliding_windows(1, 8)


def test_windowed_perplexity_of_a_bigram_model_equals_its_full_nll():
    vocab = 5
    table = jax.random.normal(jax.random.key(3), (vocab, vocab))  # logits of next | current
    ids = np.asarray(jax.random.randint(jax.random.key(4), (31,), 0, vocab))
    full = float(jnp.mean(token_nll(table[ids[:-1]], jnp.asarray(ids[1:]))))

    def score(chunk, lo, hi):
        return window_nll_sum(table[chunk], chunk, lo, hi)

    for stride in (3, 7):  # a bigram needs one token of context: overlapping plans agree
        res = windowed_perplexity(score, ids, window=8, stride=stride, progress=False)
        assert res.n_tokens == 30
        assert res.nll == pytest.approx(full, rel=1e-5)
        assert res.perplexity == pytest.approx(math.exp(full), rel=1e-5)
    res = windowed_perplexity(score, ids, window=8, progress=False)  # disjoint: skips 8, 16
    per = np.asarray(token_nll(table[ids[:-1]], jnp.asarray(ids[1:])))
    kept = [t - 1 for t in range(1, 31) if t not in (8, 16)]
    assert (res.n_tokens, res.n_windows) == (28, 4)
    assert res.nll == pytest.approx(per[kept].mean(), rel=1e-5)


def test_model_perplexity_with_one_window_equals_the_full_forward_nll():
    from lowrank_jax.models.generate import logits_full, perplexity
    from lowrank_jax.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    ids = np.arange(24) % 32
    logits = logits_full(model, jnp.asarray(ids[None]))
    want = float(cross_entropy(logits[0, :-1], jnp.asarray(ids[1:])))
    res = perplexity(model, ids, window=24, progress=False)
    assert (res.n_tokens, res.n_windows) == (23, 1)
    assert res.nll == pytest.approx(want, rel=1e-5)
