"""Dual-stream subspace attention: kernel (interpret) and blocked XLA path vs the dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention.kernel import export_lowering
from pallas_kernels.flash_attention.reference import flash_attention_reference
from pallas_kernels.subspace_attention import (
    BlockSizes,
    dual_stream_attention,
    estimate_flops,
    lookup_tables,
    subspace_attention,
    subspace_attention_reference,
)


def _inputs(n, heads, dim, rank, rank_v, *, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, n, heads, dim), np.float32) for _ in range(3))
    q_lat, k_lat = (rng.standard_normal((1, n, heads, rank), np.float32) for _ in range(2))
    v_lat = rng.standard_normal((1, n, heads, rank_v), np.float32)
    basis = np.linalg.qr(rng.standard_normal((heads, dim, rank_v)))[0].astype(np.float32)
    return [jnp.asarray(x, dtype) for x in (q, k, v, q_lat, k_lat, v_lat, basis)]


def _mask(n, bq, bk, seed=0, p=0.4):
    rng = np.random.default_rng(seed + 100)
    return jnp.asarray(rng.random((-(-n // bq), -(-n // bk))) < p)


@pytest.mark.parametrize("n,bq,bk,dim,rank,rank_v,v_residual", [
    (45, 16, 8, 12, 5, 3, "latent"),
    (45, 16, 8, 12, 5, 3, "far_exact"),
    (37, 8, 16, 20, 7, 9, "latent"),
])
def test_kernel_and_blocked_xla_equal_reference_on_odd_shapes(n, bq, bk, dim, rank, rank_v,
                                                              v_residual):
    args = _inputs(n, 2, dim, rank, rank_v)
    mask = _mask(n, bq, bk)
    ref = subspace_attention_reference(*args, mask, block_q=bq, block_k=bk, v_residual=v_residual)
    for impl in ("pallas", "xla"):
        out = subspace_attention(*args, mask, block_sizes=BlockSizes(bq, bk), implementation=impl,
                                 interpret=True, v_residual=v_residual)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_rows_with_no_near_block_and_all_near_rows():
    args = _inputs(40, 1, 16, 4, 4, seed=2)
    mask = jnp.asarray([[False, False, False], [True, True, True], [True, False, False]])
    ref = subspace_attention_reference(*args, mask, block_q=16, block_k=16)
    out = subspace_attention(*args, mask, block_sizes=BlockSizes(16, 16), implementation="pallas",
                             interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_all_near_equals_dense_attention_fp32_and_bf16():
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        args = _inputs(40, 2, 16, 4, 4, seed=3, dtype=dtype)
        dense = flash_attention_reference(*args[:3], causal=False)
        out = subspace_attention(*args, jnp.ones((3, 3), bool), block_sizes=BlockSizes(16, 16),
                                 implementation="pallas", interpret=True)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(dense, np.float32),
                                   atol=tol, rtol=tol)


def test_full_rank_identity_streams_equal_dense_for_any_mask():
    q, k, v = _inputs(33, 2, 16, 1, 1, seed=4)[:3]
    basis = jnp.broadcast_to(jnp.eye(16), (2, 16, 16))
    dense = flash_attention_reference(q, k, v, causal=False)
    for seed in range(2):
        mask = _mask(33, 8, 8, seed=seed)
        out = subspace_attention(q, k, v, q, k, v, basis, mask, block_sizes=BlockSizes(8, 8),
                                 implementation="pallas", interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=1e-5, rtol=1e-5)


def test_lookup_tables_list_exactly_the_selected_blocks():
    mask = np.asarray(_mask(70, 8, 8, seed=5))
    near_lut, near_cnt, far_lut, far_cnt = (np.asarray(x) for x in lookup_tables(mask))
    for i in range(mask.shape[0]):
        assert list(near_lut[i, :near_cnt[i]]) == list(np.flatnonzero(mask[i]))
        assert list(far_lut[i, :far_cnt[i]]) == list(np.flatnonzero(~mask[i]))
    np.testing.assert_array_equal(near_cnt + far_cnt, mask.shape[1])


def test_bad_inputs_raise_clear_errors():
    args = _inputs(40, 2, 16, 4, 4)
    with pytest.raises(ValueError, match="near_mask"):
        subspace_attention(*args, jnp.ones((2, 3), bool), block_sizes=BlockSizes(16, 16))
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(12, 16)
    with pytest.raises(ValueError, match="v_residual"):
        subspace_attention(*args, jnp.ones((3, 3), bool), block_sizes=BlockSizes(16, 16),
                           v_residual="exact")
    with pytest.raises(ValueError, match="v_basis"):
        subspace_attention(*args[:6], args[6][:, :, :2], jnp.ones((3, 3), bool),
                           block_sizes=BlockSizes(16, 16))
    with pytest.raises(ValueError, match="implementation"):
        subspace_attention(*args, jnp.ones((3, 3), bool), block_sizes=BlockSizes(16, 16),
                           implementation="cuda")


def test_flop_model_known_answers():
    dense_only = estimate_flops(64, 32, 8, 8, near_pairs=64 * 64)
    assert dense_only["subspace"] == dense_only["dense"] + 2 * 64 * 8 * 32
    half = estimate_flops(64, 32, 8, 8, near_pairs=64 * 32)
    assert half["dense"] == 4 * 32 * 64 * 64
    assert half["subspace"] == 4 * 32 * 2048 + 32 * 2048 + 2 * 64 * 8 * 32


@pytest.mark.parametrize("platform,target", [("gpu", "cuda"), ("tpu", "tpu")])
def test_kernel_lowers_for_gpu_and_tpu_at_production_blocks(platform, target):
    s = jax.ShapeDtypeStruct
    b, h, n, d, r = 1, 2, 1024, 128, 32
    n_blocks = n // 64
    shapes = ([s((b, h, n, d), jnp.bfloat16)] * 3 + [s((b, h, n, r), jnp.bfloat16)] * 3
              + [s((h, d, r), jnp.bfloat16), s((n_blocks, n_blocks), jnp.int32),
                 s((n_blocks,), jnp.int32), s((n_blocks, n_blocks), jnp.int32),
                 s((n_blocks,), jnp.int32)])

    def fn(*a):
        return dual_stream_attention(*a, block_q=64, block_k=64, n=1000, scale=d ** -0.5,
                                     platform=platform, interpret=False)

    assert export_lowering(fn, *shapes, platform=target).platforms == (target,)
