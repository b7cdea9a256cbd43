"""NF4 as QLoRA defines it: the 16 levels, blockwise absmax, nibble packing, double quant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.quant.nf4 import (
    NF4Linear,
    nf4_bits_per_weight,
    nf4_codes,
    nf4_dequantize,
    nf4_levels,
    nf4_quantize,
)

# bitsandbytes' / QLoRA's published NF4 table (Appendix E), the known answer.
QLORA_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
             0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def test_levels_equal_the_qlora_table():
    np.testing.assert_allclose(np.asarray(nf4_levels()), QLORA_NF4, atol=2e-6)


def test_codes_are_nearest_level_times_block_absmax():
    w = jax.random.normal(jax.random.PRNGKey(0), (6, 128)) * 0.02
    q = nf4_quantize(w)
    blocks = np.asarray(w).reshape(6, 2, 64)
    absmax = np.abs(blocks).max(-1)
    np.testing.assert_allclose(np.asarray(q.absmax), absmax, rtol=1e-6)
    codes = np.asarray(nf4_codes(q)).reshape(6, 2, 64)
    levels = np.asarray(QLORA_NF4)
    expect = np.abs(blocks[..., None] / absmax[..., None, None] - levels).argmin(-1)
    np.testing.assert_array_equal(codes, expect)
    deq = np.asarray(nf4_dequantize(q)).reshape(6, 2, 64)
    np.testing.assert_allclose(deq, levels[expect] * absmax[..., None], rtol=1e-5, atol=1e-8)
    # the absmax element of each block is exact
    assert np.allclose(np.abs(deq).max(-1), absmax, rtol=1e-6)
    assert q.packed.shape == (6, 64) and q.packed.dtype == jnp.uint8
    assert nf4_bits_per_weight(q) == pytest.approx(4.5)


def test_double_quant_costs_fewer_bits_and_little_error():
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 512))
    plain, dq = nf4_quantize(w), nf4_quantize(w, double_quant=True)
    assert dq.absmax.dtype == jnp.int8
    assert nf4_bits_per_weight(dq) == pytest.approx(4 + 8 / 64 + (32 * 2 + 32) / 32768)
    err_plain = float(jnp.linalg.norm(nf4_dequantize(plain) - w))
    err_dq = float(jnp.linalg.norm(nf4_dequantize(dq) - w))
    assert err_dq < 1.01 * err_plain


def test_linear_matches_dense_dequantized_matmul():
    w = jax.random.normal(jax.random.PRNGKey(2), (16, 64))
    layer = NF4Linear(nf4_quantize(w))
    x = jax.random.normal(jax.random.PRNGKey(3), (3, 5, 64))
    np.testing.assert_allclose(np.asarray(layer(x)),
                               np.asarray(x @ nf4_dequantize(nf4_quantize(w)).T), rtol=1e-5,
                               atol=1e-5)


def test_bad_block_size_names_the_parameter():
    with pytest.raises(ValueError, match="block_size=64"):
        nf4_quantize(jnp.ones((4, 48)))
    with pytest.raises(ValueError, match="block_size=3"):
        nf4_quantize(jnp.ones((4, 48)), 3)
