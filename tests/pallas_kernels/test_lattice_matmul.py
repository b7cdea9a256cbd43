"""Lattice matmul kernel (interpret mode) against its pure-jnp reference."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import aot
from pallas_kernels.lattice_matmul import cases
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


def test_tokens_and_features_sharded_over_a_mesh_match_the_reference():
    """Under a data x tensor mesh the kernel runs per (token, output-feature) shard (30 tokens
    over 4 shards: padded to 32, the padding sliced off)."""
    from jax.sharding import AxisType, PartitionSpec as P

    x, codes, affine, offset = _operands(30, 48, 8, seed=6)
    want = code_matmul_reference(x, codes, affine, offset)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.NamedSharding(mesh, P()))
        fn = jax.jit(lambda x: code_matmul(x, codes, affine, offset, mode="dequant",
                                           interpret=True, block_sizes=BlockSizes(block_m=16)))
        got = fn(xs)
        assert "sdy.manual_computation" in fn.lower(xs).as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


# ------------------------------------------------------------------ on the hardware, from a CPU
# TPU: compiled by libtpu (pip install -e ".[tpu]"); GPU: lowered by jax.export for cuda. Each
# check fails when the compiled module holds no Pallas kernel (a silent XLA fallback).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers share libtpu
SMALL = cases.compile_cases("small")


@pytest.mark.parametrize("target", ["v5e", "h100", "h200"])
@pytest.mark.parametrize("case", SMALL, ids=[c.entry for c in SMALL])
def test_small_odd_shapes_compile_to_kernels(case, target):
    assert aot.check_case(case, target)["kernels"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e", "h200"])
@pytest.mark.parametrize("case", cases.compile_cases("production"), ids=lambda c: c.entry)
def test_production_shapes_compile_to_kernels(case, target):
    assert aot.check_case(case, target)["kernels"] == 1


def test_kernel_runs_per_shard_on_a_v5e_8_data_tensor_mesh():
    """A 4096 x 4096 2-bit layer on 2048 tokens under data=4 x tensor=2: the kernel compiles
    inside shard_map; each device holds a quarter of the tokens and half of the codes."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = aot.tpu_mesh("v5e-8", {"data": 4, "tensor": 2})
    case = cases.compile_cases("production")[1]  # dequant
    t, n = 2048, 4096
    args = (jax.ShapeDtypeStruct((t, n), jnp.bfloat16),) + case.args[1:]
    shardings = (NamedSharding(mesh, P("data")), NamedSharding(mesh, P("tensor")),
                 *[NamedSharding(mesh, P())] * 4)
    compiled = aot.compile_for_tpu(case.fn, *args, mesh=mesh, in_shardings=shardings)
    assert aot.kernel_calls(compiled, "tpu") >= 1
    full = t * n * 2 + n * n // 4
    assert aot.memory_report(compiled)["argument_bytes"] < full // 3


@pytest.mark.parametrize("mode", ["fold", "dequant"])
def test_tpu_variant_in_the_tpu_interpreter(mode):
    """The Mosaic variant (affine scalars in SMEM, 128-lane tiles) in Pallas' TPU interpreter."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.lattice_matmul.kernel import lattice_planes_matmul

    x, codes, affine, offset = _operands(16, 128, 128, seed=7)
    ab = jnp.concatenate([affine.reshape(16), offset, jnp.zeros(12)])
    if mode == "fold":
        planes, correction = fold_activations(x, affine, offset)
    else:
        planes, correction = jnp.moveaxis(x.reshape(16, 128, 4), -1, 0), 0.0
    got = lattice_planes_matmul(planes, codes, ab, mode=mode, block_t=16, block_m=128,
                                block_k=128, platform="tpu", interpret=pltpu.InterpretParams())
    want = code_matmul_reference(x, codes, affine, offset)
    got = got + (correction[:, None] if mode == "fold" else 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
