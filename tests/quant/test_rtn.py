"""RTN baseline, bit packing and bits-per-weight accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.quant.packing import pack_bits, rtn_bits_per_weight, storage_bits, unpack_bits
from lowrank_jax.quant.rtn import (
    rtn_dequantize,
    rtn_from_arrays,
    rtn_quantize,
    rtn_to_arrays,
)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8])
def test_pack_bits_round_trip(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2**bits, size=37)
    stream = pack_bits(values, bits)
    assert stream.size == -(-37 * bits // 8)
    np.testing.assert_array_equal(unpack_bits(stream, bits, 37), values)


def test_pack_bits_msb_first():
    assert pack_bits(np.array([7, 0, 5]), 3).tolist() == [0b11100010, 0b10000000]


@pytest.mark.parametrize("bits, group, expected", [(2, 64, 2.5), (3, 64, 3.5),
                                                   (4, 192, 4 + 32 / 192),
                                                   (2, None, 2 + 32 / 576)])
def test_rtn_bits_per_weight_formula(bits, group, expected):
    got = rtn_bits_per_weight(576, 576, bits, group, zero_point="float")
    assert got == pytest.approx(expected, abs=1e-12)
    # the standard form stores a bits-bit integer zero instead of an fp16 offset
    integer = rtn_bits_per_weight(576, 576, bits, group)
    assert integer == pytest.approx(expected - (16 - bits) / (group or 576), abs=1e-12)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rtn_accounting_equals_stored_bits(bits):
    m, n, group = 6, 20, 4  # 3-bit stream of 120 weights = 45 bytes exactly; 2-bit 30 bytes
    w = jax.random.normal(jax.random.PRNGKey(0), (m, n))
    q = rtn_quantize(w, bits, group)
    stored = storage_bits(rtn_to_arrays(q))
    assert stored == pytest.approx(rtn_bits_per_weight(m, n, bits, group) * m * n)
    back = rtn_from_arrays(rtn_to_arrays(q), (m, n), bits, group)
    np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(q.codes))
    np.testing.assert_allclose(rtn_dequantize(back), rtn_dequantize(q), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rtn_error_within_half_step_and_grid_exact(bits):
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 32))
    q = rtn_quantize(w, bits, 8)
    err = jnp.abs(rtn_dequantize(q) - w).reshape(8, 4, 8)
    assert bool(jnp.all(err <= q.scale[..., None] * 0.5 + 2e-3))
    assert int(q.codes.max()) <= 2**bits - 1
    # values already on a 2-bit grid are reproduced exactly
    on_grid = jnp.tile(jnp.array([0.0, 0.5, 1.0, 1.5]), (2, 2))
    np.testing.assert_allclose(rtn_dequantize(rtn_quantize(on_grid, 2, 4)), on_grid, atol=0)


def test_rtn_more_bits_less_error():
    w = jax.random.normal(jax.random.PRNGKey(2), (16, 64))
    errs = [float(jnp.mean((rtn_dequantize(rtn_quantize(w, b, 16)) - w) ** 2)) for b in (2, 3, 4)]
    assert errs[0] > errs[1] > errs[2]


def test_rtn_bits_per_weight_rejects_non_divisor():
    with pytest.raises(ValueError, match="group_size=128"):
        rtn_bits_per_weight(576, 576, 2, 128)


def test_rtn_bad_bits_and_group_size():
    w = jnp.ones((4, 12))
    with pytest.raises(ValueError, match="bits=5"):
        rtn_quantize(w, 5, 4)
    with pytest.raises(ValueError, match="group_size=5.*divisor of the input dim 12"):
        rtn_quantize(w, 2, 5)
    with pytest.raises(ValueError, match="2-D"):
        rtn_quantize(jnp.ones(12), 2, 4)
