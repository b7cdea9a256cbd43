"""Lattice matmul kernel (interpret mode) against its pure-jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lattice_matmul import (
    BlockSizes,
    code_matmul,
    code_matmul_reference,
    lattice_matmul,
    lattice_matmul_reference,
)
from pallas_kernels.lattice_matmul.reference import fold_activations, planes_matmul_reference


def _operands(t, m, q, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    codes = jax.random.randint(k[0], (m, q), 0, 256).astype(jnp.uint8)
    x = jax.random.normal(k[1], (t, 4 * q)).astype(dtype)
    affine = jax.random.normal(k[2], (4, 4)) * 0.5 + jnp.eye(4)
    offset = jax.random.normal(k[3], (4,))
    return x, codes, affine, offset


@pytest.mark.parametrize("mode, t, m, q", [("fold", 3, 37, 13), ("dequant", 17, 70, 40)])
def test_kernel_equals_reference_fp32_odd_shapes(mode, t, m, q):
    # non-default BlockSizes: 16-wide code chunks (the dequant case has 3 of them, one partial)
    # and 32 output rows (37 and 70 rows: partial tiles)
    x, codes, affine, offset = _operands(t, m, q)
    ref = code_matmul_reference(x, codes, affine, offset)
    got = code_matmul(x, codes, affine, offset, mode=mode, implementation="pallas",
                      interpret=True, block_sizes=BlockSizes(block_m=32, block_k=16))
    scale = float(jnp.abs(ref).max())
    np.testing.assert_allclose(got, ref, atol=1e-5 * scale, rtol=1e-5)


def test_block_sizes_are_checked():
    with pytest.raises(ValueError, match=r"BlockSizes.block_k=24 must be a power of two >= 8"):
        BlockSizes(block_k=24)
    with pytest.raises(ValueError, match=r"BlockSizes.block_t=4 must be a power of two"):
        BlockSizes(block_t=4)
    x, codes, affine, offset = _operands(3, 8, 2)
    with pytest.raises(ValueError, match=r"code_matmul: block_sizes="):
        code_matmul(x, codes, affine, offset, interpret=True, block_sizes=(16, 16, 16))


def test_kernel_integer_part_is_exact():
    x, codes, _, _ = _operands(5, 24, 16, seed=1)
    xi = jnp.round(x * 4)  # small integers: every product and sum is exact in fp32
    planes, _ = fold_activations(xi, jnp.eye(4), jnp.zeros(4))
    got = code_matmul(xi, codes, jnp.eye(4), jnp.zeros(4), implementation="pallas",
                      interpret=True)
    np.testing.assert_array_equal(got, planes_matmul_reference(planes, codes))


@pytest.mark.parametrize("mode", ["fold"])
def test_kernel_bf16_within_2e2_relative(mode):
    x, codes, affine, offset = _operands(9, 33, 24, dtype=jnp.bfloat16, seed=2)
    ref = code_matmul_reference(x.astype(jnp.float32), codes, affine, offset)
    got = code_matmul(x, codes, affine, offset, mode=mode, implementation="pallas",
                      interpret=True)
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 2e-2


def test_full_layer_fold_equals_dense_and_dequant():
    m, n, t = 24, 32, 5
    x, codes, affine, offset = _operands(t, m, n // 4, seed=3)
    s_in = jax.random.normal(jax.random.PRNGKey(4), (n,))
    s_out = jax.random.normal(jax.random.PRNGKey(5), (m,))
    kw = dict(block_in=16, block_out=8)
    ref = lattice_matmul_reference(x, codes, s_in, s_out, affine, offset, **kw)
    for mode, impl in [("fold", "xla"), ("dequant", "xla"), ("fold", "pallas")]:
        got = lattice_matmul(x[None], codes, s_in, s_out, affine, offset, mode=mode,
                             implementation=impl, interpret=True, **kw)[0]
        np.testing.assert_allclose(got, ref, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_input():
    x, codes, affine, offset = _operands(2, 8, 4)
    with pytest.raises(ValueError, match="n=12 features"):
        code_matmul(x[:, :12], codes, affine, offset)
    with pytest.raises(ValueError, match="uint8"):
        code_matmul(x, codes.astype(jnp.int32), affine, offset)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        code_matmul(x, codes, affine, offset, implementation="cuda")
    with pytest.raises(ValueError, match="mode='lut'"):
        code_matmul(x, codes, affine, offset, mode="lut")
