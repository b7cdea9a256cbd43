"""Grouped LoRA kernels (interpret mode) vs the ragged_dot reference and a per-group loop."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import aot
from pallas_kernels.grouped_lora import cases
from pallas_kernels.grouped_lora import (
    BlockSizes,
    grouped_lora_loop_reference,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
)

# One shape (each new shape recompiles the interpreted kernel, ~10 s CPU): tiles of 16 rows,
# rank chunks of 8. Groups: odd sizes, an empty group, groups straddling the tile boundary,
# r_k = R, r_k = 1, a rank-0 slot, and rows past sum(group_sizes) (N = 27 > 22).
CASES = [((5, 0, 9, 6, 2), (3, 8, 16, 1, 0), 16, 27)]


def _data(sizes, ranks, r_max, n, d_in=24, d_out=20):
    keys = jax.random.split(jax.random.key(sum(sizes) + r_max), 5)
    k = len(sizes)
    x = jax.random.normal(keys[0], (n, d_in))
    a = jax.random.normal(keys[1], (k, d_in, r_max))
    b = jax.random.normal(keys[2], (k, r_max, d_out))
    scale = jax.random.uniform(keys[3], (k,), minval=0.5, maxval=2.0)
    acc = jax.random.normal(keys[4], (n, d_out))
    return x, a, b, jnp.array(sizes, jnp.int32), scale, jnp.array(ranks, jnp.int32), acc


@pytest.mark.parametrize("sizes,ranks,r_max,n", CASES)
def test_kernel_matches_reference(sizes, ranks, r_max, n):
    # non-default BlockSizes: 16-row tiles, rank chunks of 8, 3 chunks of the d_in contraction
    x, a, b, gs, scale, rk, acc = _data(sizes, ranks, r_max, n)
    kw = dict(implementation="pallas", interpret=True)
    h_ref = lora_shrink_reference(x, a, gs, scale, rk)
    h = lora_shrink(x, a, gs, scale, rk, block_sizes=BlockSizes(16, 8, block_k=8), **kw)
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
    y_ref = lora_expand_reference(h_ref, b, gs, rk, acc)
    y = lora_expand(h_ref, b, gs, rk, acc, block_sizes=BlockSizes(16, 8), **kw)  # default block_n
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-4)
    # ragged_dot reference == slice-per-group loop; padded rank columns exactly zero
    loop = grouped_lora_loop_reference(x, a, b, sizes, scale, ranks)
    np.testing.assert_allclose(lora_expand_reference(h_ref, b, gs, rk), loop, rtol=1e-5,
                               atol=1e-4)
    cols = np.arange(r_max)[None, :]
    gid = np.repeat(np.arange(len(sizes)), sizes)
    pad = cols >= np.asarray(ranks)[gid][:, None]
    assert np.all(np.asarray(h)[: len(gid)][pad] == 0.0)
    assert np.all(np.asarray(h)[len(gid):] == 0.0)


def test_kernel_gradients_match_reference():
    """custom_vjp wiring: all four cotangents equal jax.grad of the ragged_dot reference."""
    x, a, b, gs, scale, rk, acc = _data(*CASES[0])
    c = jax.random.normal(jax.random.key(7), acc.shape)

    def loss(impl):
        def f(x, a, b, acc):
            h = lora_shrink(x, a, gs, scale, rk, implementation=impl, interpret=True,
                            block_sizes=BlockSizes(16, 8, block_k=8))
            y = lora_expand(h, b, gs, rk, acc, implementation=impl, interpret=True,
                            block_sizes=BlockSizes(16, 8))
            return jnp.sum(y * c)
        return jax.grad(f, argnums=(0, 1, 2, 3))(x, a, b, acc)

    for got, want in zip(loss("pallas"), loss("xla")):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_arguments_raise():
    x, a, b, gs, scale, rk, _ = _data((5, 0, 13, 9), (3, 8, 16, 1), 16, 29)
    with pytest.raises(ValueError, match="group_sizes"):
        lora_shrink(x, a, gs[:3], scale, rk, implementation="xla")
    with pytest.raises(ValueError, match=r"BlockSizes.block_r=5 must be a power of two >= 8"):
        BlockSizes(block_r=5)
    with pytest.raises(ValueError, match=r"block_k=16 does not tile d_in=24"):
        lora_shrink(x, a, gs, scale, rk, implementation="pallas", interpret=True,
                    block_sizes=BlockSizes(block_k=16))
    with pytest.raises(ValueError, match=r"lora_shrink: block_sizes=.* must be a pallas_kernels"):
        lora_shrink(x, a, gs, scale, rk, implementation="pallas", interpret=True,
                    block_sizes=dict(block_m=16))
    with pytest.raises(ValueError, match="implementation"):
        lora_expand(x[:, :16], b, gs, rk, implementation="cuda")


@pytest.mark.parametrize("in_grid, splits", [(True, None), (False, None), (False, 2)])
def test_weight_gradient_kernel_both_row_reductions(in_grid, splits):
    """tgmm: rows reduced in the grid (TPU layout) or in a kernel loop over row splits (Triton
    layout; 3 row tiles in 3 splits, or in 2 uneven ones), all equal the per-group
    ``(lhs_k ⊙ m_k)ᵀ rhs_k``; empty groups and rank-0 slots give zeros."""
    from pallas_kernels.grouped_lora.kernel import grouped_tn

    sizes, ranks = np.array([5, 0, 20, 7]), np.array([3, 8, 8, 0])
    lhs = jax.random.normal(jax.random.key(0), (48, 8))
    rhs = jax.random.normal(jax.random.key(1), (48, 32))
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes), [32, 32, 32]]), jnp.int32)
    rk = jnp.asarray(np.concatenate([ranks, [0, 0, 0, 0]]), jnp.int32)
    got = grouped_tn(offsets, rk, lhs, rhs, num_groups=4, block_m=16, block_n=16,
                     reduce_rows_in_grid=in_grid, row_splits=splits)
    want, start = np.zeros((4, 8, 32), np.float32), 0
    for k, size in enumerate(sizes):
        want[k, :ranks[k]] = np.asarray(lhs[start:start + size, :ranks[k]]).T @ np.asarray(
            rhs[start:start + size])
        start += size
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rows_sharded_over_a_mesh_match_the_reference():
    """Under a mesh with a data axis, each shard runs the kernel on its rows (shard_map) with
    its own cut of the groups; values and gradients equal the unsharded reference. 30 rows over
    4 shards: the rows are padded to 32 (in no group) and the padding sliced off."""
    from jax.sharding import AxisType, PartitionSpec as P

    x, a, b, gs, scale, rk, c = _data((5, 0, 13, 9), (3, 8, 16, 1), 16, 30)
    tiles = BlockSizes(16, 8, block_k=8)

    def loss(impl):
        def f(x, a, b):
            h = lora_shrink(x, a, gs, scale, rk, implementation=impl, interpret=True,
                            block_sizes=tiles)
            y = lora_expand(h, b, gs, rk, implementation=impl, interpret=True,
                            block_sizes=BlockSizes(16, 8))
            return jnp.sum(y * c) + 0.5 * jnp.sum(jnp.square(h))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    want = loss("xla")(x, a, b)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.NamedSharding(mesh, P()))
        got = loss("pallas")(xs, a, b)
        text = jax.jit(lambda x: lora_shrink(x, a, gs, scale, rk, interpret=True,
                                             block_sizes=tiles)).lower(xs).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # fp32, |values| up to ~50
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


# ------------------------------------------------------------------ on the hardware, from a CPU
# TPU: compiled by libtpu (pip install -e ".[tpu]"); GPU: lowered by jax.export for cuda. Each
# check fails when the compiled module holds no Pallas kernel (a silent XLA fallback).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers share libtpu
SMALL = cases.compile_cases("small")


@pytest.mark.parametrize("target", ["v5e", "h100", "h200"])
@pytest.mark.parametrize("case", SMALL, ids=[c.entry for c in SMALL])
def test_small_odd_shapes_compile_to_kernels(case, target):
    result = aot.check_case(case, target)
    # backward: value_and_grad runs the forward kernel and the two backward kernels
    assert result["kernels"] == (1 if case.entry in ("shrink", "expand") else 3)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e", "h200"])
@pytest.mark.parametrize("case", cases.compile_cases("production"), ids=lambda c: c.name)
def test_production_shapes_compile_to_kernels(case, target):
    assert aot.check_case(case, target)["kernels"] >= 1


def test_kernels_run_per_shard_on_a_v5e_8_data_mesh():
    """Forward and backward of shrink + expand under a data=8 mesh: the kernels compile inside
    shard_map, each device holds 1/8 of the tokens."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = aot.tpu_mesh("v5e-8", {"data": 8})
    n, d, k, r = 8192, 4096, 8, 16
    sds = jax.ShapeDtypeStruct

    def step(x, a, b, gs, scale, rk):
        def loss(x, a, b):
            y = lora_expand(lora_shrink(x, a, gs, scale, rk).astype(b.dtype), b, gs, rk)
            return jnp.mean(jnp.square(y))
        return jax.grad(loss, argnums=(0, 1, 2))(x, a, b)

    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    compiled = aot.compile_for_tpu(
        step, sds((n, d), jnp.bfloat16), sds((k, d, r), jnp.bfloat16),
        sds((k, r, d), jnp.bfloat16), sds((k,), jnp.int32), sds((k,), jnp.float32),
        sds((k,), jnp.int32), mesh=mesh, in_shardings=(rows, rep, rep, rep, rep, rep))
    assert aot.kernel_calls(compiled, "tpu") >= 6  # 2 forward + 4 backward kernels
    memory = aot.memory_report(compiled)
    assert memory["argument_bytes"] < n * d * 2 // 4  # the tokens are split, not gathered


def test_tpu_variants_in_the_tpu_interpreter():
    """The Mosaic variants (SMEM metadata, lane-dense weights, rows reduced in the grid) run in
    Pallas' TPU interpreter, which models SMEM / VMEM, and equal the references."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.grouped_lora.kernel import grouped_nn, grouped_nt, grouped_tn

    tpu = dict(platform="tpu", interpret=pltpu.InterpretParams())
    sizes, ranks = np.array([5, 0, 20, 7]), np.array([3, 8, 8, 0])
    x, a, b, _, scale, _, _ = _data(tuple(sizes), tuple(ranks), 8, 32, d_in=128, d_out=128)
    offsets = jnp.asarray(np.concatenate([[0], np.cumsum(sizes), [32] * 3]), jnp.int32)
    rk = jnp.asarray(np.concatenate([ranks, [0] * 4]), jnp.int32)
    pad = jnp.zeros(4)
    h = grouped_nt(offsets, rk, jnp.concatenate([scale, pad]), x, jnp.swapaxes(a, 1, 2),
                   block_m=16, block_r=8, block_k=128, **tpu)
    np.testing.assert_allclose(h, lora_shrink_reference(x, a, sizes, scale, ranks), atol=1e-4)
    y = grouped_nn(offsets, rk, jnp.concatenate([jnp.ones(4), pad]), h, b, block_m=16,
                   block_r=8, block_n=128, **tpu)
    np.testing.assert_allclose(y, lora_expand_reference(h, b, sizes, ranks), atol=1e-4)
    grad = grouped_tn(offsets, rk, h, x, num_groups=4, block_m=16, block_n=128, **tpu)
    want = grouped_tn(offsets, rk, h, x, num_groups=4, block_m=16, block_n=128,
                      reduce_rows_in_grid=False)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-4)
