"""Tests for lowrank_jax.kv.xkv: exactness, byte accounting, selective reconstruction, model."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.attention import reference_attention
from lowrank_jax.kv import xkv
from lowrank_jax.models.llama import Llama, LlamaConfig, apply_rope
from pallas_kernels.xkv_decode import rope, xkv_decode_attention


def _kv(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape, np.float32)),
            jnp.asarray(rng.standard_normal(shape, np.float32)))


@pytest.mark.parametrize("n_layers,group_size", [(3, 2)])  # groups (0, 1), (2,)
def test_full_rank_reconstruction_is_exact(n_layers, group_size):
    keys, values = _kv((n_layers, 2, 10, 2, 8))  # L = 10 <= hk*d, so full rank = 10
    cache = xkv.xkv_compress(keys, values, rope_theta=1e4, rank=10, group_size=group_size)
    assert cache.groups == xkv.layer_groups(n_layers, group_size)
    for layer in range(n_layers):
        np.testing.assert_allclose(xkv.xkv_reconstruct(cache, layer, "k"), keys[layer],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(xkv.xkv_reconstruct(cache, layer, "v"), values[layer],
                                   rtol=1e-5, atol=1e-5)


def test_remainder_rule_puts_leftover_layers_in_last_group():
    assert xkv.layer_groups(30, 4)[-1] == (28, 29)
    assert len(xkv.layer_groups(30, 4)) == 8


def test_eckart_young_error_and_identical_layers():
    keys, _ = _kv((2, 1, 12, 1, 8))
    x = jnp.concatenate([keys[0, 0].reshape(12, 8), keys[1, 0].reshape(12, 8)], axis=1)
    sigma = np.linalg.svd(np.asarray(x), compute_uv=False)
    errors = []
    for rank in (2, 5, 9):
        cache = xkv.xkv_compress(keys, keys, rope_theta=1e4, rank=rank, group_size=2)
        rec = jnp.concatenate([xkv.xkv_reconstruct(cache, l)[0].reshape(12, 8) for l in (0, 1)],
                              axis=1)
        err = float(jnp.linalg.norm(rec - x))
        np.testing.assert_allclose(err, np.sqrt(np.sum(sigma[rank:] ** 2)), rtol=1e-4)
        errors.append(err)
    assert errors == sorted(errors, reverse=True)
    # identical layers: group SVD at rank r has exactly the per-layer SVD error at rank r
    same = jnp.stack([keys[0], keys[0]])
    grouped = xkv.xkv_compress(same, same, rope_theta=1e4, rank=3, group_size=2)
    single = xkv.xkv_compress(same, same, rope_theta=1e4, rank=3, group_size=1)
    e_group = jnp.linalg.norm(xkv.xkv_reconstruct(grouped, 1) - same[1])
    e_single = jnp.linalg.norm(xkv.xkv_reconstruct(single, 1) - same[1])
    np.testing.assert_allclose(e_group, e_single, rtol=1e-4)
    assert grouped.key_factors[0].size * 2 == sum(a.size for a in single.key_factors)


@pytest.mark.parametrize("ratio,group_size", [(2.0, 2), (4.0, 3), (3.0, 1)])
def test_reported_ratio_is_stored_bytes_over_uncompressed(ratio, group_size):
    keys, values = _kv((4, 2, 64, 2, 8))
    cache = xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=ratio, group_size=group_size,
                             tail_capacity=5)
    cache = dataclasses.replace(cache, tail_length=jnp.asarray(3, jnp.int32))
    stored = sum(int(a.nbytes) for a in cache.key_factors + cache.value_factors
                 + cache.key_bases + cache.value_bases)
    stored += 3 * 2 * 4 * 2 * 2 * 8 * 4  # 3 exact tail tokens, K and V, 4 layers, fp32
    full = (64 + 3) * 2 * 4 * 2 * 2 * 8 * 4
    assert xkv.compressed_bytes(cache) == stored
    assert xkv.uncompressed_bytes(cache) == full
    assert xkv.compression_ratio(cache) == pytest.approx(full / stored, rel=1e-12)
    prompt_only = dataclasses.replace(cache, tail_length=jnp.asarray(0, jnp.int32))
    assert xkv.compression_ratio(prompt_only) >= ratio  # ranks are floored: the target is met


def test_selective_bytes_are_counted_and_ratio_met():
    keys, values = _kv((2, 1, 64, 2, 8))
    cfg = xkv.SelectiveConfig(budget=16, chunk_size=4, local_chunks=1, outlier_chunks=2)
    cache = xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=2.0, group_size=2,
                             selective=cfg)
    stored = sum(int(a.nbytes) for a in jax.tree.leaves(
        [cache.key_factors, cache.value_factors, cache.key_bases, cache.value_bases,
         cache.selective]))
    assert xkv.compressed_bytes(cache) == stored
    assert xkv.compression_ratio(cache) >= 2.0


def test_predicted_ratio_reproduces_paper_settings():
    common = dict(n_layers=32, kv_heads=8, head_dim=128, tokens=65536)
    assert round(xkv.predicted_compression_ratio(group_size=4, rank_k=384, rank_v=576,
                                                 **common), 2) == 8.03
    assert round(xkv.predicted_compression_ratio(group_size=1, rank_k=96, rank_v=144,
                                                 **common), 2) == 8.40


def test_unreachable_ratios_raise():
    keys, values = _kv((2, 1, 16, 1, 4))
    with pytest.raises(ValueError, match="ratio=1000"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=1000.0, group_size=2)
    with pytest.raises(ValueError, match="too low"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=0.2, group_size=2)
    with pytest.raises(ValueError, match="ratio"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=-1.0, group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=2.0, group_size=3)
    with pytest.raises(ValueError, match="rank_k"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, rank=(9, 2), group_size=1)


def test_selective_with_all_chunks_equals_dense_decode():
    b, hk, d, length = 1, 2, 8, 32
    keys, values = _kv((1, b, length, hk, d), seed=1)
    cfg = xkv.SelectiveConfig(budget=length, chunk_size=4, local_chunks=0, outlier_chunks=0)
    cache = xkv.xkv_compress(keys, values, rope_theta=1e4, rank=(3, 5), group_size=1,
                             selective=cfg)
    q, _ = _kv((b, 2 * hk, d), seed=2)
    tail_k, tail_v = _kv((b, 3, hk, d), seed=3)
    sel = xkv.selective_decode_attention(q, cache, 0, tail_keys=tail_k, tail_values=tail_v,
                                         tail_length=2)
    dense = xkv_decode_attention(q, cache.key_factors[0], cache.key_bases[0],
                                 cache.value_factors[0], cache.value_bases[0], rope_theta=1e4,
                                 tail_keys=tail_k, tail_values=tail_v, tail_length=2,
                                 implementation="xla")
    np.testing.assert_allclose(sel, dense, rtol=1e-5, atol=1e-5)


def test_selective_full_rank_with_outliers_equals_exact_attention():
    b, hk, d, length = 1, 1, 8, 30
    keys, values = _kv((1, b, length, hk, d), seed=4)
    cfg = xkv.SelectiveConfig(budget=length, chunk_size=4, local_chunks=1, outlier_chunks=2)
    cache = xkv.xkv_compress(keys, values, rope_theta=1e4, rank=8, group_size=1,
                             selective=cfg)
    q, _ = _kv((b, 2, d), seed=5)
    sel = xkv.selective_decode_attention(q, cache, 0)
    exact_k = rope(keys[0], jnp.arange(length), 1e4)
    exact = reference_attention(q[:, None], exact_k, values[0], causal=False)[:, 0]
    np.testing.assert_allclose(sel, exact, rtol=1e-4, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _tiny_model_and_logits():
    """A random tiny Llama, 2 sequences of 13 tokens, and its exact logits (computed once)."""
    cfg = LlamaConfig(vocab_size=40, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                      rope_theta=500.0)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 40, (2, 13)), jnp.int32)
    logits = nnx.jit(lambda m, t: m(t)[0])(model, tokens)
    return model, tokens, logits


@pytest.mark.parametrize("sink", [0, 2])  # 0: the paper; 2: exact sinks, shifted RoPE frame
def test_full_rank_decode_matches_uncompressed_model_and_block_protocol(sink):
    model, tokens, full_logits = _tiny_model_and_logits()
    # prefill 8 tokens at full rank of the factorized part (min(8 - sink, G*hk*d)), then decode
    # tokens 8..11 one by one: equals the uncompressed model
    cache = xkv.xkv_prefill(model, tokens[:, :8], rank=8 - sink, group_size=2, max_new_tokens=4,
                            sink_tokens=sink)
    assert cache.groups == ((0, 1), (2,)) and cache.sink_tokens == sink
    for step in range(4):
        logits, cache = xkv.xkv_decode_step(model, cache, tokens[:, 8 + step])
        np.testing.assert_allclose(logits, full_logits[:, 8 + step], rtol=1e-4, atol=1e-4)
    # low rank: the teacher-forced block used by xkv_perplexity equals token-by-token decode
    cache = xkv.xkv_prefill(model, tokens[:, :8], rank=(2, 3), group_size=2, max_new_tokens=4,
                            sink_tokens=sink)
    ctx_k = jnp.stack([rope(xkv.xkv_reconstruct(cache, l, "k"), jnp.arange(8), 500.0)
                       for l in range(3)])
    ctx_v = jnp.stack([xkv.xkv_reconstruct(cache, l, "v") for l in range(3)])
    block, _ = model(tokens[:, 8:12], cache=xkv.ContextKV(ctx_k, ctx_v))  # the shared forward
    for step in range(4):
        logits, cache = xkv.xkv_decode_step(model, cache, tokens[:, 8 + step])
        np.testing.assert_allclose(logits, block[:, step], rtol=1e-4, atol=1e-4)
    assert not np.allclose(block, full_logits[:, 8:12], atol=1e-3)  # rank 2 really compresses


def test_perplexity_protocol_without_compression_matches_model():
    model, tokens, full_logits = _tiny_model_and_logits()
    ppl = xkv.xkv_perplexity(model, tokens, context_len=8, eval_len=4, method="none")
    logp = jax.nn.log_softmax(full_logits[:, 8:12], axis=-1)
    nll = -float(jnp.mean(jnp.take_along_axis(logp, tokens[:, 9:13, None], axis=-1)))
    assert ppl == pytest.approx(math.exp(nll), rel=1e-4)
    with pytest.raises(ValueError, match="method"):
        xkv.xkv_perplexity(model, tokens, context_len=8, eval_len=4, method="svd")


def test_rope_convention_matches_model():
    x, _ = _kv((2, 5, 3, 8), seed=8)
    pos = jnp.arange(5) + 7
    np.testing.assert_allclose(rope(x, pos, 1e4),
                               apply_rope(x, jnp.broadcast_to(pos, (2, 5)), 1e4), atol=1e-6)


def test_cache_factory_validates():
    factory = xkv.xkv_cache_factory(8, 4)
    assert (factory.ratio, factory.group_size) == (8.0, 4)
    with pytest.raises(ValueError, match="ratio=0.0 must be > 0"):
        xkv.xkv_cache_factory(0.0, 4)


def test_sink_tokens_are_exact_and_counted():
    keys, values = _kv((4, 1, 40, 2, 8), seed=9)
    cache = xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=4.0, group_size=2,
                             sink_tokens=3)
    assert cache.sink_tokens == 3 and cache.key_factors[0].shape[1] == 37
    for layer in range(4):  # the sink rows come back bit-exact at any rank
        np.testing.assert_array_equal(xkv.xkv_reconstruct(cache, layer, "k")[:, :3],
                                      keys[layer, :, :3])
        np.testing.assert_array_equal(xkv.xkv_reconstruct(cache, layer, "v")[:, :3],
                                      values[layer, :, :3])
    stored = sum(int(a.nbytes) for a in cache.key_factors + cache.value_factors
                 + cache.key_bases + cache.value_bases)
    stored += 2 * 4 * 3 * 2 * 8 * 4  # K and V of 3 sink tokens, 4 layers, fp32
    assert xkv.compressed_bytes(cache) == stored
    assert xkv.compression_ratio(cache) >= 4.0  # the sink is paid from the same budget
    rk, rv = cache.ranks[0]
    budget = 2 * 2 * 40 * 2 * 8 / 4.0 - 2 * 3 * 2 * 2 * 8
    assert rk + rv == int(budget // (37 + 2 * 2 * 8))
    # the factorized part is the paper's SVD of the remaining tokens
    rest = xkv.xkv_compress(keys[:, :, 3:], values[:, :, 3:], rope_theta=1e4,
                            rank=cache.ranks[0], group_size=2)
    np.testing.assert_allclose(xkv.xkv_reconstruct(cache, 1)[:, 3:],
                               xkv.xkv_reconstruct(rest, 1), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="sink_tokens"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=4.0, sink_tokens=40)
    with pytest.raises(ValueError, match="selective"):
        xkv.xkv_compress(keys, values, rope_theta=1e4, ratio=2.0, sink_tokens=1,
                         selective=xkv.SelectiveConfig(budget=8, chunk_size=4, local_chunks=1,
                                                       outlier_chunks=1))


def test_model_level_helpers_keep_the_first_token_exact_by_default():
    model, tokens, _ = _tiny_model_and_logits()
    keys, values = xkv.prefill_kv(model, tokens[:, :8])
    cache = xkv.xkv_prefill(model, tokens[:, :8], rank=1, group_size=3)
    factory_cache = xkv.XKVCacheFactory(ratio=2.0, group_size=3).prefill(model, tokens[:, :8])
    assert cache.sink_tokens == factory_cache.sink_tokens == xkv.DEFAULT_SINK_TOKENS
    for layer in range(3):  # the default sink row is bit-exact; rank 1 loses the rest
        rebuilt = xkv.xkv_reconstruct(cache, layer, "k")
        np.testing.assert_array_equal(rebuilt[:, :cache.sink_tokens],
                                      keys[layer, :, :cache.sink_tokens])
        assert not np.allclose(rebuilt[:, cache.sink_tokens:],
                               keys[layer, :, cache.sink_tokens:], atol=1e-3)
    # the paper's setting (sink 0) rebuilds the first token with the same loss as the rest
    paper = xkv.xkv_prefill(model, tokens[:, :8], rank=1, group_size=3, sink_tokens=0)
    assert paper.sink_tokens == 0
    assert not np.allclose(xkv.xkv_reconstruct(paper, 0, "k")[:, :1], keys[0, :, :1],
                           atol=1e-3)


def test_randomized_svd_matches_exact_on_a_decaying_spectrum():
    rng = np.random.default_rng(11)
    # 4 layers of keys with a decaying spectrum (as real caches have): rank 6 plus small noise
    signal = rng.standard_normal((4, 1, 80, 6)) @ rng.standard_normal((4, 1, 6, 2 * 8))
    keys = jnp.asarray((signal + 0.01 * rng.standard_normal(signal.shape))
                       .reshape(4, 1, 80, 2, 8).astype(np.float32))
    kw = dict(rope_theta=1e4, rank=(6, 6), group_size=2, sink_tokens=1)
    exact = xkv.xkv_compress(keys, keys, **kw)
    fast = xkv.xkv_compress(keys, keys, svd_method="randomized", oversample=4, **kw)
    assert fast.key_factors[0].shape == exact.key_factors[0].shape == (1, 79, 6)
    for layer in range(4):
        e_exact = float(jnp.linalg.norm(xkv.xkv_reconstruct(exact, layer) - keys[layer]))
        e_fast = float(jnp.linalg.norm(xkv.xkv_reconstruct(fast, layer) - keys[layer]))
        assert e_fast <= 1.01 * e_exact + 1e-6, (layer, e_fast, e_exact)
    with pytest.raises(ValueError, match="svd_method"):
        xkv.xkv_compress(keys, keys, svd_method="lanczos", **kw)
