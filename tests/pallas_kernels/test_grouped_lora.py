"""Grouped LoRA kernels (interpret mode) vs the ragged_dot reference and a per-group loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
