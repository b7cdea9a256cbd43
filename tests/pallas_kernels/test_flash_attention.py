"""Flash attention: Pallas kernel (interpret mode) vs the jnp reference, gradients, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.attention import get_attention, reference_attention
from pallas_kernels.flash_attention import api, kernel, reference

TOL = {jnp.float32: dict(atol=2e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _qkv(tq, tk, heads, kv_heads, dim, dtype, seed=0):
    rng = np.random.default_rng(seed)  # numpy inputs: no per-op JAX compiles in the tests
    q = rng.standard_normal((1, tq, heads, dim), np.float32)
    k, v = rng.standard_normal((2, 1, tk, kv_heads, dim), np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize(
    "tq, tk, heads, kv_heads, dim, dtype, causal, blocks",
    [
        (40, 40, 3, 3, 16, jnp.float32, True, (16, 16)),  # GQA ratio 1, 40 = 2.5 blocks
        (37, 37, 3, 1, 32, jnp.bfloat16, True, (16, 32)),  # GQA ratio 3, bf16
        (45, 70, 8, 1, 16, jnp.float32, False, (32, 16)),  # GQA ratio 8, tq != tk
    ],
)
def test_flash_kernel_matches_reference(tq, tk, heads, kv_heads, dim, dtype, causal, blocks):
    q, k, v = _qkv(tq, tk, heads, kv_heads, dim, dtype)
    out = api.flash_attention(q, k, v, causal=causal, implementation="pallas", interpret=True,
                              block_sizes=api.BlockSizes(*blocks))
    ref, truth = jax.jit(lambda q, k, v: (
        reference.flash_attention_reference(q, k, v, causal=causal),
        reference_attention(q, k, v, causal=causal)))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               **TOL[dtype])
    # the reference itself agrees with the dispatcher's ground truth
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(truth, np.float32),
                               **TOL[dtype])


def test_flash_gradients_match_reference():
    q, k, v = _qkv(40, 40, 3, 1, 16, jnp.float32, seed=1)
    weights = jnp.cos(jnp.arange(16.0))

    def loss(implementation):
        def f(q, k, v):
            out = api.flash_attention(q, k, v, implementation=implementation, interpret=True,
                                      block_sizes=api.BlockSizes(16, 16))
            return jnp.sum(out * weights)
        return f

    grads, expected = jax.jit(lambda q, k, v: (
        jax.grad(loss("pallas"), argnums=(0, 1, 2))(q, k, v),
        jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    for name, g, e in zip("qkv", grads, expected):
        assert g.shape == e.shape, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-5, rtol=1e-4,
                                   err_msg=f"d{name}")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="block_q=24"):
        api.BlockSizes(24, 16)
    with pytest.raises(ValueError, match="block_k=4"):
        api.BlockSizes(16, 4)
    q, k, v = _qkv(8, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        api.flash_attention(q, k, v)
    q, k, v = _qkv(8, 4, 2, 1, 16, jnp.float32)
    with pytest.raises(ValueError, match="q_len=8 > kv_len=4"):
        api.flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="implementation="):
        api.flash_attention(q, k, v, causal=False, implementation="cuda")
    with pytest.raises(ValueError, match="interpret=True"):
        api.flash_attention(q, k, v, causal=False, implementation="pallas", interpret=False)


def test_block_sizes_fit_short_sequences():
    assert api.BlockSizes(128, 128).fitted(40, 70) == api.BlockSizes(64, 128)
    assert api.BlockSizes(128, 64).fitted(5, 5) == api.BlockSizes(16, 16)
    assert api.resolve_implementation("auto") == "xla"  # tests run on CPU


def test_dispatcher_flash_prefill_and_decode_fallback():
    fn = get_attention("flash")
    q, k, v = _qkv(12, 12, 4, 2, 16, jnp.float32, seed=2)

    @jax.jit
    def both(q, k, v):
        # decode with a KV cache: q_offset / kv_length fall back to the reference
        pad = ((0, 0), (0, 4), (0, 0), (0, 0))
        decode = fn(q[:, -1:], jnp.pad(k, pad), jnp.pad(v, pad), q_offset=11, kv_length=12)
        return fn(q, k, v), decode, reference_attention(q, k, v)

    prefill, decode, truth = both(q, k, v)
    np.testing.assert_allclose(prefill, truth, atol=1e-6)
    np.testing.assert_allclose(decode, truth[:, -1:], atol=1e-6)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_flash_lowers_for_accelerators(platform):
    """Mosaic-TPU and Triton lowering at production tiles (128×128, d=128, bf16, GQA 2)."""
    q = jax.ShapeDtypeStruct((1, 4, 512, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 4, 512, 1), jnp.float32)
    static = dict(scale=128 ** -0.5, block_q=128, block_k=128,
                  masks=kernel.Masks(causal=True, kv_len=500),
                  platform="tpu" if platform == "tpu" else "gpu", interpret=False)
    fwd = kernel.export_lowering(lambda q, k, v: kernel.flash_forward(q, k, v, **static),
                                 q, kv, kv, platform=platform)
    bwd = kernel.export_lowering(
        lambda q, k, v, o, l, do: kernel.flash_backward(q, k, v, o, l, do, **static),
        q, kv, kv, q, lse, q, platform=platform)
    assert fwd.platforms == (platform,) and bwd.platforms == (platform,)
    assert [a.shape for a in fwd.out_avals] == [(1, 4, 512, 128), (1, 4, 512, 1)]
    assert [a.shape for a in bwd.out_avals] == [(1, 4, 512, 128), (1, 2, 512, 128)] + [
        (1, 2, 512, 128)]


def _masked_cases():
    rng = np.random.default_rng(3)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 37)), axis=1))
    return [dict(window=5, logit_softcap=0.7),
            dict(window=9, logit_softcap=1.5, segment_ids=(seg, seg))]


@pytest.mark.parametrize("masks", _masked_cases(), ids=["window_softcap", "all"])
def test_flash_masks_forward_and_backward_match_reference(masks):
    """Sliding window, soft-cap and segment ids: kernel output and gradients (interpret mode)
    equal the reference's, GQA 2, 37 tokens in 16-token tiles (padding, skipped blocks)."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 37, 2, 16)), jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    def kern(q, k, v):
        return api.flash_attention(q, k, v, implementation="pallas", interpret=True,
                                   block_sizes=api.BlockSizes(16, 16), **masks)

    def ref(q, k, v):
        return reference_attention(q, k, v, causal=True, **masks)

    out, want, grads, expected = jax.jit(lambda q, k, v: (
        kern(q, k, v), ref(q, k, v), jax.grad(loss(kern), argnums=(0, 1, 2))(q, k, v),
        jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    for name, g, e in zip("qkv", grads, expected):
        np.testing.assert_allclose(g, e, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")


def test_tpu_streaming_kernels_match_reference_in_interpret_mode():
    """The TPU kernels (K/V streamed block by block, scratch accumulators): forward and
    gradients with every mask option, GQA 2, in interpret mode."""
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 37, 2, 16)), jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.standard_normal((2, 37, 4, 16)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 37)), axis=1))
    masks = dict(window=9, logit_softcap=1.5, segment_ids=(seg, seg))

    def kern(q, k, v):
        return api.flash_attention(q, k, v, implementation="pallas", interpret=True,
                                   platform="tpu", block_sizes=api.BlockSizes(16, 16), **masks)

    def ref(q, k, v):
        return reference_attention(q, k, v, **masks)

    def grad(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights), argnums=(0, 1, 2))

    out, want, grads, expected = jax.jit(lambda q, k, v: (
        kern(q, k, v), ref(q, k, v), grad(kern)(q, k, v), grad(ref)(q, k, v)))(q, k, v)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
    for name, g, e in zip("qkv", grads, expected):
        np.testing.assert_allclose(g, e, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")


def test_flash_masks_non_causal_cross_attention():
    """Window without causality and segments over different q / kv lengths (45 vs 70)."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 45, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 70, 1, 16)), jnp.float32) for _ in range(2))
    q_seg = jnp.asarray(rng.integers(0, 2, (1, 45)))
    kv_seg = jnp.asarray(rng.integers(0, 2, (1, 70)))
    masks = dict(causal=False, window=20, segment_ids=(q_seg, kv_seg))
    out = api.flash_attention(q, k, v, implementation="pallas", interpret=True,
                              block_sizes=api.BlockSizes(16, 32), **masks)
    np.testing.assert_allclose(out, reference_attention(q, k, v, **masks), atol=2e-5)
    with pytest.raises(ValueError, match="window=0"):
        api.flash_attention(q, k, v, causal=False, window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        api.flash_attention(q, k, v, causal=False, logit_softcap=-1.0)
    with pytest.raises(ValueError, match="segment_ids shapes"):
        api.flash_attention(q, k, v, causal=False, segment_ids=(kv_seg, q_seg))


def test_reference_window_softcap_and_segments_against_loops():
    """The reference's sliding window, soft-cap and segment ids equal a per-query loop."""
    rng = np.random.default_rng(0)
    b, t, h, hk, d, window, cap = 2, 9, 4, 2, 8, 3, 0.5
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, hk, hk))
    seg = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0] * 9])
    got = reference_attention(q, k, v, window=window, logit_softcap=cap, segment_ids=(seg, seg))
    want = np.zeros((b, t, h, d))
    for bi in range(b):
        for i in range(t):
            keys = [j for j in range(t) if j <= i and j > i - window and seg[bi, j] == seg[bi, i]]
            for head in range(h):
                kv_head = head // (h // hk)
                s = np.array([float(q[bi, i, head] @ k[bi, j, kv_head]) for j in keys]) * d ** -0.5
                s = cap * np.tanh(s / cap)
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                want[bi, i, head] = p @ np.asarray(v[bi, keys, kv_head])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    with pytest.raises(ValueError, match="window=0"):
        reference_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="segment_ids shapes"):
        reference_attention(q, k, v, segment_ids=(seg[:, :3], seg))
