"""SALE: quantization, selection, block-sparse kernel (interpret mode) vs references, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.attention import get_attention, reference_attention, register_sale_per_layer
from pallas_kernels.flash_attention.kernel import export_lowering
from pallas_kernels.flash_attention.reference import flash_attention_reference
from pallas_kernels.sparse_attention import api, kernel
from pallas_kernels.sparse_attention import reference as R

CFG = R.SaleConfig(block_q=16, block_k=16, block_seg=32, local_window=16, dense_below=0)


def _qkv(n, heads, kv_heads, dim, dtype=jnp.float32, seed=0, layout="bnhd"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, n, heads, dim), np.float32)
    k, v = rng.standard_normal((2, 1, n, kv_heads, dim), np.float32)
    arrays = [jnp.asarray(x, dtype) for x in (q, k, v)]
    if layout == "bhnd":
        arrays = [jnp.transpose(x, (0, 2, 1, 3)) for x in arrays]
    return arrays


def test_int4_quantization_error_range_and_zero_rows():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 20, 16)) * 3, jnp.float32).at[0, 0, 5].set(0.0)
    for rows in (None, 8):
        codes, scale = jax.jit(R.quantize_int4_symmetric, static_argnums=1)(x, rows)
        codes, scale = np.asarray(codes), np.asarray(scale)
        assert codes.dtype == np.int8 and codes.min() >= -7 and codes.max() <= 7
        err = np.abs(np.asarray(x) - scale[..., None] * codes)
        assert np.all(err <= scale[..., None] / 2 + 1e-6)
        assert np.all(np.isfinite(scale))
    codes, scale = jax.jit(R.quantize_int4_symmetric)(x)
    assert float(scale[0, 0, 5]) == 0.0 and not np.asarray(codes[0, 0, 5]).any()


def test_estimated_logits_are_exact_for_codes_and_centring_is_softmax_invariant():
    q, k, _ = _qkv(24, 4, 2, 16, layout="bhnd")
    qk4, prod, est = jax.jit(lambda q, k: (
        lambda qk4: (qk4, R.integer_qk(qk4.q_codes, qk4.k_codes), R.estimated_logits(qk4)))(
        R.quantize_qk_int4(q, k)))(q, k)
    prod, est = np.asarray(prod), np.asarray(est)
    q_codes = np.asarray(qk4.q_codes, np.int64)
    k_codes = np.repeat(np.asarray(qk4.k_codes, np.int64), 2, axis=1)
    np.testing.assert_array_equal(prod, np.einsum("bhqd,bhkd->bhqk", q_codes, k_codes))
    exact = np.einsum("bhqd,bhkd->bhqk", np.asarray(q), np.repeat(np.asarray(qk4.k_centred), 2, 1))
    assert np.corrcoef(est.ravel(), exact.ravel())[0, 1] > 0.95  # 4-bit estimate tracks Q·K̃
    # centring K shifts each row by a constant: same softmax
    raw = np.einsum("bhqd,bhkd->bhqk", np.asarray(q), np.repeat(np.asarray(k), 2, 1))
    shift = raw - exact
    np.testing.assert_allclose(shift, shift[..., :1].repeat(24, -1), atol=1e-4)


def test_log_domain_test_equals_relative_attention_score():
    q, k, _ = _qkv(48, 2, 1, 16, layout="bhnd", seed=3)
    tau = jnp.asarray([0.01, 0.002])
    c = 16 ** -0.5

    @jax.jit
    def tests(q, k):
        qk4 = R.quantize_qk_int4(q, k)
        m, l = R.anchor_stats(q, qk4.k_centred, CFG)
        est = R.estimated_logits(qk4)
        ras = jnp.exp(c * (est - m[..., None])) / l[..., None]
        thresholds = R.selection_thresholds(m, l, tau, c)
        return est > thresholds[..., None], ras > tau[None, :, None, None], ras

    log_test, ras_test, ras = (np.asarray(x) for x in tests(q, k))
    away = np.abs(np.asarray(ras) - np.asarray(tau)[None, :, None, None]) > 1e-6
    np.testing.assert_array_equal(log_test[away], ras_test[away])


def test_anchor_stats_match_dense_masked_computation():
    n = 75
    q, k, _ = _qkv(n, 3, 1, 16, layout="bhnd", seed=4)
    k_c = k - k.mean(axis=2, keepdims=True)
    m, l = jax.jit(lambda q, k_c: R.anchor_stats(q, k_c, CFG))(q, k_c)
    anchor = R.expand_block_mask(R.anchor_block_mask(n, CFG), n, CFG)
    s = np.einsum("bhqd,bhkd->bhqk", np.asarray(q), np.repeat(np.asarray(k_c), 3, 1))
    s_m = np.where(anchor, s, -np.inf)
    m_ref = s_m.max(-1)
    l_ref = np.where(anchor, np.exp(16 ** -0.5 * (s - m_ref[..., None])), 0).sum(-1)
    np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)


def test_anchor_layout_follows_the_spec():
    # repo defaults: Bq=64, Bk=32, 4 blocks per segment, 4 local blocks
    cfg = R.SaleConfig()
    anchor = R.anchor_block_mask(4096, cfg)
    d = R.diagonal_blocks(4096, cfg)
    for i in (3, 10, 63):
        local = np.flatnonzero(anchor[i])[1:]
        assert anchor[i, 0] and local[-1] == d[i] and len(local) >= 4
        assert (d[i] - len(local)) % 4 == 0  # middle blocks 1..d-n_loc form whole segments


@pytest.mark.parametrize(
    "n, heads, kv_heads, dim, dtype",
    [(75, 3, 1, 16, jnp.float32), (70, 8, 1, 32, jnp.bfloat16), (50, 2, 2, 16, jnp.float32)],
)
def test_sale_kernels_match_reference(n, heads, kv_heads, dim, dtype):
    """Pallas selection + block-sparse kernels == jnp reference; τ=0 heads == dense attention."""
    q, k, v = _qkv(n, heads, kv_heads, dim, dtype, seed=n)
    taus = jnp.asarray(([0.0, 0.05, np.inf] * 3)[:heads], jnp.float32)  # dense / sparse / anchor
    out, mask = api.sale_prefill_attention(q, k, v, taus, CFG, implementation="pallas",
                                           interpret=True, return_mask=True)
    ref_out, ref_mask, dense = jax.jit(lambda q, k, v: api.sale_prefill_attention(
        q, k, v, taus, CFG, implementation="xla", return_mask=True) + (
        flash_attention_reference(q, k, v),))(q, k, v)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(ref_mask))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), **tol)
    for h in range(heads):
        if float(taus[h]) == 0.0:  # every block selected == dense causal attention
            np.testing.assert_allclose(np.asarray(out[:, :, h], np.float32),
                                       np.asarray(dense[:, :, h], np.float32), **tol)
    causal = R.causal_block_mask(n, CFG)
    assert not np.asarray(mask)[..., ~causal].any()  # never a block above the diagonal
    anchor_only = np.asarray(mask)[0, 2 % heads] if heads > 2 else None
    if anchor_only is not None:
        np.testing.assert_array_equal(anchor_only, R.anchor_block_mask(n, CFG))


def test_block_sizes_replace_the_config_tiles():
    # non-default BlockSizes over a config with the default 64 x 32 tiles: the 16 x 16 kernel
    # (the same compiled one as CFG's, above) and the same mask and values as CFG's reference
    q, k, v = _qkv(75, 3, 1, 16, seed=75)
    taus = jnp.asarray([0.0, 0.05, np.inf], jnp.float32)
    wide = R.SaleConfig(block_seg=32, local_window=16, dense_below=0)
    out, mask = api.sale_prefill_attention(q, k, v, taus, wide, implementation="pallas",
                                           interpret=True, return_mask=True,
                                           block_sizes=api.BlockSizes(16, 16))
    ref_out, ref_mask = api.sale_prefill_attention(q, k, v, taus, CFG, implementation="xla",
                                                   return_mask=True)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(ref_mask))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
    assert api.BlockSizes.of(wide) == api.BlockSizes() == api.BlockSizes(64, 32)
    with pytest.raises(ValueError, match=r"BlockSizes.block_k=12 must be a power of two >= 8"):
        api.BlockSizes(16, 12)
    with pytest.raises(ValueError, match=r"block_seg=32 must be a multiple of block_k=64"):
        api.sale_prefill_attention(q, k, v, taus, CFG, block_sizes=api.BlockSizes(16, 64))


@pytest.mark.parametrize("lut_words", [1 << 16, 40])  # one call; chunks of 5 rows (a scan)
def test_tpu_block_sparse_kernel_matches_reference_in_interpret_mode(lut_words):
    n = 75
    q, k, v = _qkv(n, 3, 1, 16, layout="bhnd", seed=7)
    rng = np.random.default_rng(0)
    causal = R.causal_block_mask(n, CFG)
    mask = jnp.asarray((rng.random((1, 3) + causal.shape) < 0.4) & causal)
    mask = mask | jnp.asarray(R.anchor_block_mask(n, CFG))  # random middles, some empty
    lut, counts = api.lookup_table(mask)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 80 - n), (0, 0)))  # noqa: E731
    out = kernel.block_sparse_attention_tpu(
        pad(q), pad(k), pad(v), lut, counts, block_q=16, block_k=16, n=n, scale=0.25,
        platform="interpret", interpret=True, lut_words=lut_words)[:, :, :n]
    ref = jax.jit(lambda q, k, v, mask: R.block_sparse_attention_reference(
        q, k, v, mask, CFG))(q, k, v, mask)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_mask_causality_and_monotonicity():
    n = 64
    q, k, v = _qkv(n, 2, 1, 16, seed=5)

    @jax.jit
    def run(q, k, v, tau):
        return api.sale_prefill_attention(q, k, v, tau, CFG, implementation="xla",
                                          return_mask=True)

    masks = [np.asarray(run(q, k, v, jnp.float32(t))[1]) for t in (1e-4, 1e-3, 1e-2, 1e-1)]
    for loose, strict in zip(masks, masks[1:]):
        assert not (strict & ~loose).any()  # τ1 < τ2 ⇒ mask(τ2) ⊆ mask(τ1)
    # perturbing future keys and values never changes earlier outputs
    out = np.asarray(run(q, k, v, jnp.float32(1e-3))[0])
    k2 = k.at[:, 40:].add(5.0)
    v2 = v.at[:, 40:].add(5.0)
    out2 = np.asarray(run(q, k2, v2, jnp.float32(1e-3))[0])
    np.testing.assert_allclose(out[:, :40], out2[:, :40], atol=1e-5)


def test_planted_needle_block_is_selected():
    n = 128
    q, k, v = _qkv(n, 1, 1, 16, seed=6, layout="bhnd")
    q, k = q * 0.1, k * 0.1
    k = k.at[0, 0, 37].set(q[0, 0, 110] * 60.0)  # key 37 (block 2) is the needle for query 110
    out, mask = jax.jit(lambda q, k, v: R.sale_prefill_reference(
        q, k, v, jnp.asarray([0.01]), CFG, return_mask=True))(q, k, v)
    mask = np.asarray(mask)[0, 0]
    assert mask[110 // 16, 37 // 16]
    assert mask[:, 1:].sum() < mask.size / 2  # the rest stays sparse


def test_calibration_halving_fixed_points():
    qkv = (np.zeros((1, 3, 10, 4)),) * 3

    def stub(layer, inputs, tau):
        # head 0: error proportional to τ; head 1: never within budget; head 2: always fine
        return np.asarray([1000.0 * tau[0], 1e9, 0.0]) * (layer + 1)

    taus = R.calibrate_thresholds([qkv, qkv], CFG, error_fn=stub)
    # budget err·N = 4: layer 0 stops at 0.002 (E=2), layer 1 at 0.001 (E=2); head 1 → 0 (dense)
    np.testing.assert_allclose(taus, [[0.002, 0.0, 0.008], [0.001, 0.0, 0.008]], rtol=1e-6)
    real = R.calibrate_thresholds([_qkv(48, 2, 1, 16, layout="bhnd")], CFG, err=0.05)
    assert real.shape == (1, 2) and np.all((real == 0) | (real >= 1e-4))


def test_dispatcher_sale_and_bad_inputs():
    fn = get_attention("sale")
    q, k, v = _qkv(12, 4, 2, 16, seed=8)
    out = jax.jit(lambda q, k, v: fn(q[:, -1:], k, v, q_offset=11, kv_length=12))(q, k, v)
    np.testing.assert_allclose(out, reference_attention(q, k, v)[:, -1:], atol=1e-6)
    with pytest.raises(ValueError, match="one threshold per query head"):
        api.sale_prefill_attention(q, k, v, jnp.zeros(3), CFG)
    with pytest.raises(ValueError, match="block_seg=40"):
        R.SaleConfig(block_k=16, block_seg=40)
    with pytest.raises(ValueError, match="granularity"):
        R.SaleConfig(granularity="per_warp")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sale_kernels_lower_for_accelerators(platform):
    """Selection + block-sparse kernels at production tiles (128×128 on TPU, d=128, GQA 2)."""
    s = jax.ShapeDtypeStruct
    i8, f32, i32 = jnp.int8, jnp.float32, jnp.int32
    plat = "tpu" if platform == "tpu" else "gpu"
    select = export_lowering(
        lambda *a: kernel.sale_select(*a, block_q=128, block_k=128, n=1000, local_blocks=1,
                                      blocks_per_segment=1, platform=plat, interpret=False),
        s((1, 4, 1024, 128), i8), s((1, 4, 1024, 1), f32), s((1, 4, 1024, 1), f32),
        s((1, 2, 1024, 128), i8), s((1, 2, 1, 1024), f32), s((1, 4, 1, 1024), f32),
        platform=platform)
    sparse_fn = kernel.block_sparse_attention_tpu if plat == "tpu" else (
        kernel.block_sparse_attention)
    q = s((1, 4, 1024, 128), jnp.bfloat16)
    kv = s((1, 2, 1024, 128), jnp.bfloat16)
    sparse = export_lowering(
        lambda *a: sparse_fn(*a, block_q=128, block_k=128, n=1000, scale=0.088,
                             platform=plat, interpret=False),
        q, kv, kv, s((1, 4, 8, 8), i32), s((1, 4, 8), i32), platform=platform)
    assert select.platforms == sparse.platforms == (platform,)
    assert sparse.out_avals[0].shape == (1, 4, 1024, 128)


def test_register_sale_per_layer_uses_each_layers_thresholds():
    taus = np.array([[0.0, 0.0], [0.5, 0.5]], np.float32)  # layer 0 dense, layer 1 very sparse
    names = register_sale_per_layer(taus, CFG, implementation="xla")
    assert len(set(names)) == 2
    assert register_sale_per_layer(taus, CFG, implementation="xla") == names
    q, k, v = _qkv(96, 2, 1, 16, seed=3)
    for name, tau in zip(names, taus):
        want = api.sale_prefill_attention(q, k, v, tau, CFG, implementation="xla")
        np.testing.assert_allclose(get_attention(name)(q, k, v, causal=True), want, atol=1e-6)
    dense = get_attention(names[0])(q, k, v, causal=True)
    np.testing.assert_allclose(dense, reference_attention(q, k, v, causal=True), atol=1e-5)
    assert not np.allclose(get_attention(names[1])(q, k, v, causal=True), dense, atol=1e-3)
    with pytest.raises(ValueError, match="taus"):
        register_sale_per_layer(np.array([[-1.0]]))
