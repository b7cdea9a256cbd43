"""Tests for the KV-cache methods registry: KIVI quantization, xKV with quantized factors,
all-in byte accounting, decoding and generation from every method."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.kv import methods, quantized
from lowrank_jax.kv.hybrid import xkv_quant_compress
from lowrank_jax.models.llama import Llama, LlamaConfig

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("kv.test_kv_methods")

FP16_TOL = dict(rtol=2e-3, atol=2e-3)


def _kv(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape, np.float32)),
            jnp.asarray(rng.standard_normal(shape, np.float32)))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, 37).astype(np.uint8)
    packed = quantized.pack_kv_codes(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.size == -(-37 * bits // 8)
    np.testing.assert_array_equal(quantized.unpack_kv_codes(packed, bits, 37), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_error_is_half_a_step_and_grids_are_exact(bits):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 20, 6)), jnp.float32)
    q = quantized.quantize(x, bits, axis=1, group_size=8)  # 20 = 2 groups of 8 + a padded one
    assert q.scale.shape == (3, 3, 1, 6)
    step = np.repeat(np.asarray(q.scale, np.float32), 8, axis=1)[:, :20]
    err = np.abs(np.asarray(quantized.dequantize_kv(q)) - np.asarray(x))
    assert np.all(err <= 0.5 * step[:, :, 0] + 2e-3)  # + fp16 rounding of the minimum
    # a group holding only 2^bits equally spaced levels comes back exactly
    levels = jnp.asarray(np.random.default_rng(2).integers(0, 2 ** bits, (4, 16)), jnp.float32)
    levels = levels.at[:, 0].set(0).at[:, 1].set(2 ** bits - 1)
    grid = quantized.quantize(levels, bits, axis=1, group_size=16)
    np.testing.assert_array_equal(quantized.dequantize_kv(grid), levels)


def test_kivi_layout_and_full_window_is_exact():
    keys, values = _kv((2, 1, 50, 2, 8))
    cache = quantized.kivi_compress(keys, values, rope_theta=1e4, bits=2, group_size=16,
                                    residual=10, sink_tokens=1)
    # 49 tokens after the sink: 32 quantized (2 groups), the remaining 17 >= 10 exact
    assert cache.keys.shape == (2, 1, 32, 2, 8) and cache.residual_keys.shape[2] == 17
    assert cache.keys.scale.shape == (2, 1, 2, 1, 2, 8)  # per channel, per 16-token group
    assert cache.values.scale.shape == (2, 1, 32, 2, 1, 1)  # per token (8 channels <= 16)
    rebuilt = quantized.kivi_reconstruct(cache, None, "k")
    exact_rows = np.r_[0, 33:50]
    np.testing.assert_array_equal(rebuilt[:, :, exact_rows],
                                  keys[:, :, exact_rows].astype(jnp.float16).astype(jnp.float32))
    assert not np.allclose(rebuilt[:, :, 1:33], keys[:, :, 1:33], atol=1e-2)
    # "full bits": a window covering the whole prompt is the exact (fp16) cache
    full = quantized.kivi_compress(keys, values, rope_theta=1e4, residual=50)
    assert full.keys is None
    for kind, src in (("k", keys), ("v", values)):
        np.testing.assert_array_equal(quantized.kivi_reconstruct(full, 1, kind),
                                      src[1].astype(jnp.float16).astype(jnp.float32))


def test_kivi_bytes_match_arrays_and_ratio_choice():
    keys, values = _kv((3, 2, 300, 2, 64))
    for ratio in (2.0, 4.0):
        cache = methods.compress_kv("kivi", keys, values, rope_theta=1e4, ratio=ratio)
        arrays = [cache.keys.codes, cache.keys.scale, cache.keys.minimum, cache.values.codes,
                  cache.values.scale, cache.values.minimum, cache.sink_keys, cache.sink_values,
                  cache.residual_keys, cache.residual_values]
        assert methods.stored_bytes(cache) == sum(int(a.nbytes) for a in arrays)
        q = cache.keys.shape[2]
        settings = dict(bits=cache.bits, group_size=cache.keys.group_size,
                        residual=300 - q)
        assert methods.stored_bytes(cache) == quantized.kivi_stored_bytes(
            n_layers=3, batch=2, tokens=300, kv_heads=2, head_dim=64, **settings)
        assert methods.reference_bytes(cache) == 2 * 3 * 2 * 300 * 2 * 64 * 2  # fp16
        assert methods.cache_ratio(cache) >= ratio
    with pytest.raises(ValueError, match="out of reach"):
        methods.compress_kv("kivi", keys, values, rope_theta=1e4, ratio=8.0)


FULL_OPTIONS = {
    "none": {},
    "xkv": dict(rank="full", group_size=2),
    "per_layer_svd": dict(rank="full"),
    "kivi": dict(bits=2, group_size=32, residual=24),
    "xkv_quant": dict(rank="full", factor_bits=16, basis_bits=16, group_size=2),
    "xkv_quant_energy": dict(rank="full", factor_bits=16, basis_bits=16, group_size=3,
                             key_normalization=True),
    # full rank, fp16 factors, an exact recent window: the exact cache (rotation only applies
    # to quantized factors)
    "xkv_quant_hadamard": dict(rank="full", factor_bits=16, basis_bits=16, group_size=3,
                               recent_tokens=5),
    "xkv_quant_split": dict(rank="full", factor_bits=16, value_factor_bits=16, basis_bits=16),
    "xkv_quant_wide": dict(rank="full", factor_bits=16, value_factor_bits=16, basis_bits=16),
    "xkv_mixed": dict(rank="full", group_size=2),  # every direction at 16 bits (fp16)
}


def test_every_method_has_a_full_rank_test():
    assert set(FULL_OPTIONS) == set(methods.KV_METHODS)


@pytest.mark.parametrize("name", sorted(methods.KV_METHODS))
def test_full_rank_or_bits_reproduces_the_exact_cache(name):
    keys, values = _kv((3, 1, 24, 2, 8), seed=3)
    cache = methods.compress_kv(name, keys, values, rope_theta=1e4, ratio=None,
                                **FULL_OPTIONS[name])
    rk, rv = methods.reconstruct_all(name, cache)
    np.testing.assert_allclose(rk, keys, **FP16_TOL)
    np.testing.assert_allclose(rv, values, **FP16_TOL)


BYTES_CASES = [("xkv", 4.0), ("per_layer_svd", 3.0), ("kivi", 2.0), ("xkv_quant", 8.0),
               ("xkv_quant_energy", 8.0), ("xkv_quant_hadamard", 8.0),
               ("xkv_quant_hadamard", 16.0), ("xkv_quant_split", 8.0), ("xkv_quant_split", 16.0),
               ("xkv_quant_wide", 8.0), ("xkv_quant_wide", 16.0), ("xkv_mixed", 8.0),
               ("xkv_mixed", 16.0)]


def test_every_compressed_method_has_a_bytes_and_a_chat_test():
    compressed = set(methods.KV_METHODS) - {"none"}
    assert {name for name, _ in BYTES_CASES} == compressed
    assert {p.values[0] for p in CHAT_CASES} == set(methods.KV_METHODS)


@pytest.mark.parametrize("name,ratio", BYTES_CASES)
def test_target_ratio_is_met_with_every_stored_byte_counted(name, ratio):
    keys, values = _kv((4, 1, 160, 2, 16), seed=4)
    cache = methods.compress_kv(name, keys, values, rope_theta=1e4, ratio=ratio)
    leaves = jax.tree.leaves(cache)
    if name in ("xkv", "per_layer_svd"):  # the (empty) decode tail is not prompt storage
        leaves = jax.tree.leaves([cache.key_factors, cache.value_factors, cache.key_bases,
                                  cache.value_bases, cache.sink_keys, cache.sink_values])
    assert methods.stored_bytes(cache) == sum(int(x.nbytes) for x in leaves)
    assert all(x.dtype in (jnp.float16, jnp.uint8) for x in leaves)  # no hidden fp32
    assert ratio <= methods.cache_ratio(cache) < 1.25 * ratio


def test_quantized_factors_buy_rank_and_energy_allocation_follows_the_spectrum():
    rng = np.random.default_rng(5)
    # keys exactly rank 3 per group, values full rank: energy allocation gives V the rank
    low = rng.standard_normal((2, 1, 96, 3)) @ rng.standard_normal((2, 1, 3, 32))
    keys = jnp.asarray(low.reshape(2, 1, 96, 2, 16), jnp.float32)
    _, values = _kv((2, 1, 96, 2, 16), seed=6)
    fp16 = methods.compress_kv("xkv", keys, values, rope_theta=1e4, ratio=4.0, group_size=2)
    quant = xkv_quant_compress(keys, values, rope_theta=1e4, ratio=4.0, group_size=2,
                               factor_bits=4)
    assert sum(quant.ranks[0]) > 2 * sum(fp16.ranks[0])  # 4-bit A, 8-bit B: > 2x the rank
    energy = xkv_quant_compress(keys, values, rope_theta=1e4, ratio=4.0, group_size=2,
                                allocation="energy")
    (rk, rv), = energy.ranks
    uniform = xkv_quant_compress(keys, values, rope_theta=1e4, ratio=4.0, group_size=2)
    assert rv > 3 * rk and rv > uniform.ranks[0][1]  # the full-rank values get the budget
    assert methods.cache_ratio(energy) >= 4.0
    with pytest.raises(ValueError, match="factor_bits"):
        xkv_quant_compress(keys, values, rope_theta=1e4, ratio=4.0, factor_bits=3)
    with pytest.raises(ValueError, match="unknown"):
        methods.compress_kv("svd", keys, values, rope_theta=1e4)


@functools.lru_cache(maxsize=None)
def _tiny():
    cfg = LlamaConfig(vocab_size=40, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                      rope_theta=500.0)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 40, (2, 45)), jnp.int32)
    logits = nnx.jit(lambda m, t: m(t)[0])(model, tokens)
    return model, tokens, logits


def test_decoding_from_an_exact_or_full_window_cache_matches_the_model():
    from lowrank_jax.kv import prefill_kv

    model, tokens, full_logits = _tiny()
    keys, values = prefill_kv(model, tokens[:, :40])
    for name, opts in (("none", {}), ("kivi", dict(bits=2, group_size=32, residual=40))):
        cache = methods.compress_kv(name, keys, values, rope_theta=500.0, ratio=None, **opts)
        provider = methods.start_decode(name, cache, max_new_tokens=4)
        for step in range(4):
            logits, provider = methods.kv_decode_step(model, provider, tokens[:, 40 + step])
            np.testing.assert_allclose(logits, full_logits[:, 40 + step], rtol=1e-2, atol=1e-2)


def test_decoding_a_compressed_cache_equals_the_perplexity_block():
    from lowrank_jax.kv import ContextKV, prefill_kv
    from pallas_kernels.xkv_decode import rope

    model, tokens, full_logits = _tiny()
    keys, values = prefill_kv(model, tokens[:, :40])
    cache = methods.compress_kv("kivi", keys, values, rope_theta=500.0, ratio=None, bits=2,
                                group_size=16, residual=4)
    rk, rv = methods.reconstruct_all("kivi", cache)
    ctx_k = jax.vmap(lambda k: rope(k, jnp.arange(40), 500.0))(rk)
    block, _ = model(tokens[:, 40:44], cache=ContextKV(ctx_k, rv))
    provider = methods.start_decode("kivi", cache, max_new_tokens=4)
    for step in range(4):
        logits, provider = methods.kv_decode_step(model, provider, tokens[:, 40 + step])
        np.testing.assert_allclose(logits, block[:, step], rtol=5e-3, atol=5e-3)
    assert not np.allclose(block, full_logits[:, 40:44], atol=1e-3)  # 2 bits really compress


@pytest.mark.parametrize("name", sorted(methods.KV_METHODS))
def test_generate_from_every_method_is_greedy_on_its_own_cache(name):
    """Each generated token is the argmax of the logits the model gives, in one block forward,
    over the method's reconstructed prompt cache (:func:`methods.reconstruct_all`) and the
    tokens generated before it: the incremental decode path (kernel or rebuild-per-step) and
    the dense reference agree, for every method."""
    from lowrank_jax.kv import ContextKV, prefill_kv
    from pallas_kernels.xkv_decode import rope

    model, tokens, full_logits = _tiny()
    prompt, new = tokens[:1, :40], 3
    ratio = None if name == "none" else 2.0
    out = methods.kv_generate(model, prompt, method=name, ratio=ratio, max_new_tokens=new)
    assert out.shape == (1, new)
    keys, values = prefill_kv(model, prompt[:, :-1])
    options = {"tail_capacity": new} if name in ("xkv", "per_layer_svd") else {}
    cache = methods.compress_kv(name, keys, values, rope_theta=500.0, ratio=ratio, **options)
    rk, rv = methods.reconstruct_all(name, cache)
    ctx_k = jax.vmap(lambda k: rope(k, jnp.arange(39), 500.0))(rk)
    fed = jnp.concatenate([prompt[:, -1:], out[:, :-1]], axis=1)  # what each step was given
    block, _ = model(fed, cache=ContextKV(ctx_k, rv))
    block = np.asarray(block[0])
    picked = block[np.arange(new), np.asarray(out[0])]
    np.testing.assert_array_less(block.max(axis=-1) - picked, 1e-3)  # argmax up to ties
    if name == "none":  # the exact cache: the full model's own greedy continuation
        ref = full_logits[0, 39]
        assert int(out[0, 0]) == int(jnp.argmax(ref)) or ref.max() - ref[out[0, 0]] < 1e-3


CHAT_CONTEXT = (
    "France is a country in Western Europe. It borders Belgium, Luxembourg, Germany, "
    "Switzerland, Italy, Monaco, Spain and Andorra. Its largest city is also its capital, "
    "a city on the river Seine that is famous for the Eiffel Tower, the Louvre museum and "
    "its cafes. The country is known for its wine, its cheese and its long history. It has "
    "a population of about 68 million people and its currency is the euro. ")


CHAT_CASES = [
    # the exact cache's answer is tests/models/test_loading.py::test_smollm2_greedy_chat_answer
    pytest.param("none", None, marks=pytest.mark.slow), pytest.param("xkv", 4.0),
    # the quantized-factor methods cost ~60 s each on 2 cores; every method's generation on the
    # tiny preset stays in the default run (test_generate_runs_from_every_method)
    pytest.param("xkv_quant", 4.0, marks=pytest.mark.slow),
    # per-layer SVD at 4x loses the answer ("The answer to this question is:"): that is the
    # baseline xKV beats; at 2x it keeps it
    pytest.param("per_layer_svd", 2.0, marks=pytest.mark.slow),
    pytest.param("kivi", 3.0, marks=pytest.mark.slow),
    pytest.param("xkv_quant_energy", 4.0, marks=pytest.mark.slow),
    # at 8x xkv_quant_split / _hadamard answer "The answer to this question is: France": the
    # +5 % perplexity of 8x (docs/results/kv_cache.md) is enough to lose this answer
    pytest.param("xkv_quant_hadamard", 4.0, marks=pytest.mark.slow),
    pytest.param("xkv_quant_split", 4.0, marks=pytest.mark.slow),
    # at 8x it answers "The answer is: France": on this 132-token prompt its 256-token factor
    # groups are half padding (counted), so it has less rank than on long prompts
    pytest.param("xkv_quant_wide", 4.0, marks=pytest.mark.slow),
    # at 8x: "The capital of France is Paris." (xkv_quant_split / _wide lose it at 8x); at 16x
    # it loses the answer on this 132-token prompt (half of each 256-token group is padding)
    pytest.param("xkv_mixed", 8.0, marks=pytest.mark.slow)]


@pytest.mark.smollm2
@pytest.mark.parametrize("name,ratio", CHAT_CASES)
def test_smollm2_chat_answer_from_every_compressed_cache(name, ratio, smollm2):
    model, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": CHAT_CONTEXT
                                       + "What is the capital of France?"}])
    ids = jnp.asarray([tok.encode(prompt)], jnp.int32)
    out = methods.kv_generate(model, ids, method=name, ratio=ratio, max_new_tokens=10)
    text = tok.decode([int(t) for t in out[0]])
    assert "Paris" in text, (name, text)


def test_hadamard_rotation_is_orthonormal_and_spreads_outliers():
    from lowrank_jax.kv.hybrid import hadamard_rotate, randomized_hadamard

    h = randomized_hadamard(32)
    np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-6)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, 64, 5)), jnp.float32)
    x = x.at[:, 7].multiply(40.0)  # one outlier token per group of 32
    rotated = hadamard_rotate(x, 1, 32)
    np.testing.assert_allclose(hadamard_rotate(rotated, 1, 32, inverse=True), x, atol=1e-4)
    # 4-bit min/max quantization of the rotated array loses far less than of the raw one
    err = lambda y: float(jnp.linalg.norm(quantized.dequantize_kv(
        quantized.quantize(y, 4, axis=1, group_size=32)) - y))  # noqa: E731
    assert err(rotated) < 0.5 * err(x)
    with pytest.raises(ValueError, match="power of two"):
        randomized_hadamard(24)


def test_recent_window_and_sinks_are_exact_and_hadamard_factors_are_counted():
    keys, values = _kv((4, 1, 150, 2, 16), seed=9)
    cache = xkv_quant_compress(keys, values, rope_theta=1e4, ratio=4.0, group_size=2,
                               recent_tokens=12, hadamard=True, factor_bits=4)
    assert cache.recent_keys.shape == (4, 1, 12, 2, 16)
    # 150 - 1 sink - 12 recent = 137 factored tokens, padded to 5 groups of 32 and rotated
    assert cache.key_factors[0].shape[1] == 160
    for kind, src in (("k", keys), ("v", values)):
        rebuilt = methods.reconstruct_all("xkv_quant", cache)[kind == "v"]
        exact = src.astype(jnp.float16).astype(jnp.float32)
        np.testing.assert_array_equal(rebuilt[:, :, 138:], exact[:, :, 138:])
        np.testing.assert_array_equal(rebuilt[:, :, :1], exact[:, :, :1])
        assert rebuilt.shape == src.shape
    leaves = jax.tree.leaves(cache)
    assert methods.stored_bytes(cache) == sum(int(x.nbytes) for x in leaves)
    assert 4.0 <= methods.cache_ratio(cache) < 5.0
    with pytest.raises(ValueError, match="recent_tokens"):
        xkv_quant_compress(keys, values, rope_theta=1e4, ratio=4.0, recent_tokens=149)


def test_split_bits_buy_value_rank_and_store_key_factors_at_8_bits():
    keys, values = _kv((4, 1, 160, 2, 16), seed=10)
    split = methods.compress_kv("xkv_quant_split", keys, values, rope_theta=1e4, ratio=6.0)
    same = methods.compress_kv("xkv_quant", keys, values, rope_theta=1e4, ratio=6.0)
    assert split.key_factors[0].bits == 8 and split.value_factors[0].bits == 4
    assert split.ranks[0][1] > same.ranks[0][1]  # cheaper value factors: more value rank
    assert methods.cache_ratio(split) >= 6.0
    assert methods.stored_bytes(split) == sum(int(x.nbytes) for x in jax.tree.leaves(split))
    with pytest.raises(ValueError, match="value_factor_bits"):
        methods.compress_kv("xkv_quant_split", keys, values, rope_theta=1e4, ratio=6.0,
                            value_factor_bits=5)


@pytest.mark.parametrize("name,ratio", [("xkv", 4.0), ("per_layer_svd", 3.0),
                                        ("xkv_quant_split", 8.0)])
def test_shared_svd_cache_gives_the_same_cache_and_computes_each_svd_once(name, ratio):
    from lowrank_jax.kv import SVDCache

    keys, values = _kv((4, 1, 96, 2, 16), seed=7)
    fresh = methods.compress_kv(name, keys, values, rope_theta=1e4, ratio=ratio)
    shared = SVDCache()
    first = methods.compress_kv(name, keys, values, rope_theta=1e4, ratio=ratio,
                                svd_cache=shared)
    n_svds = len(shared)
    assert n_svds == 2 * len(first.groups)  # one SVD per group for K and for V
    assert len(first.groups) == (4 if name == "per_layer_svd" else 1)
    again = methods.compress_kv(name, keys, values, rope_theta=1e4, ratio=2 * ratio,
                                svd_cache=shared)
    assert len(shared) == n_svds  # another ratio truncates the same SVDs
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(first)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-5, atol=1e-5)
    rk, _ = methods.reconstruct_all(name, again)
    rk_fresh, _ = methods.reconstruct_all(
        name, methods.compress_kv(name, keys, values, rope_theta=1e4, ratio=2 * ratio))
    np.testing.assert_allclose(rk, rk_fresh, rtol=1e-5, atol=1e-5)


def test_wide_groups_store_fewer_scales_and_buy_rank_at_equal_bytes():
    keys, values = _kv((4, 1, 1025, 2, 16), seed=11)  # 1 sink + 1024 factored tokens
    wide = methods.compress_kv("xkv_quant_wide", keys, values, rope_theta=1e4, ratio=8.0)
    split = methods.compress_kv("xkv_quant_split", keys, values, rope_theta=1e4, ratio=8.0)
    a_wide, a_split = wide.key_factors[0], split.key_factors[0]
    assert a_wide.group_size == methods.WIDE_QUANT_GROUP and a_split.group_size == 32
    # one fp16 scale and minimum per 256 tokens of a rank channel instead of per 32
    per_rank = lambda q, r: q.scale.size // r  # noqa: E731
    assert per_rank(a_split, split.ranks[0][0]) == 8 * per_rank(a_wide, wide.ranks[0][0])
    assert wide.ranks[0][0] > split.ranks[0][0] and sum(wide.ranks[0]) > sum(split.ranks[0])
    rk, rv = wide.ranks[0]
    assert rv / rk == pytest.approx(methods.WIDE_VALUE_RANK_SCALE, abs=0.1)  # more to K
    assert methods.cache_ratio(wide) >= 8.0
    assert methods.stored_bytes(wide) == sum(int(x.nbytes) for x in jax.tree.leaves(wide))


def test_clip_search_lowers_low_bit_error_and_keeps_the_format():
    x = jnp.asarray(np.random.default_rng(12).standard_normal((4, 256)), jnp.float32)
    for bits, gain in ((1, 1.5), (2, 1.5), (4, 1.05)):
        plain = quantized.quantize(x, bits, axis=1, group_size=256)
        clipped = quantized.quantize(x, bits, axis=1, group_size=256, search_clip=True)
        assert clipped.codes.shape == plain.codes.shape and clipped.scale.shape == (4, 1, 1)
        err = lambda q: float(jnp.sum((quantized.dequantize_kv(q) - x) ** 2))  # noqa: E731
        assert err(clipped) * gain < err(plain), bits  # min/max wastes levels on the tails
    # the grid keeps c = 1 (min/max): a group that is already on the grid stays exact
    grid = jnp.asarray([[0., 1., 2., 3.]])
    exact = quantized.quantize(grid, 2, axis=1, group_size=4, search_clip=True)
    np.testing.assert_allclose(quantized.dequantize_kv(exact), grid)


def test_mixed_bits_follow_the_spectrum_and_beat_one_width_at_equal_bytes():
    from lowrank_jax.kv.mixed import xkv_mixed_compress

    rng = np.random.default_rng(13)
    # a decaying spectrum sigma_j = 10 * 0.9^j over 64 directions, 1 sink + 256 tokens
    u = np.linalg.qr(rng.standard_normal((257, 64)))[0]
    v = np.linalg.qr(rng.standard_normal((64, 64)))[0]
    x = (u * 10 * 0.9 ** np.arange(64)) @ v.T
    keys = jnp.asarray(np.stack([x[:, :32], x[:, 32:]]).reshape(2, 1, 257, 2, 16), jnp.float32)
    values = keys[::-1]
    cache = xkv_mixed_compress(keys, values, rope_theta=1e4, ratio=8.0, group_size=2)
    bits = [fa for fa, _, _ in cache.tiers(0, "k")]
    assert max(bits) >= 4 and min(bits) <= 2  # strong directions many bits, weak ones few
    assert methods.cache_ratio(cache) >= 8.0
    assert methods.stored_bytes(cache) == sum(int(x.nbytes) for x in jax.tree.leaves(cache))
    err = lambda name, c: float(  # noqa: E731
        jnp.linalg.norm(methods.reconstruct_all(name, c)[0] - keys) / jnp.linalg.norm(keys))
    one = methods.compress_kv("xkv_quant_split", keys, values, rope_theta=1e4, ratio=8.0,
                              group_size=2)
    assert methods.stored_bytes(cache) <= methods.stored_bytes(one) * 1.02
    assert err("xkv_mixed", cache) < 0.8 * err("xkv_quant_split", one)
