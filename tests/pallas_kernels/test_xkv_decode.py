"""Tests for pallas_kernels.xkv_decode: kernel (interpret mode) against its reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.attention import reference_attention
from pallas_kernels.xkv_decode import (
    BlockSizes,
    reconstruct,
    rope,
    xkv_decode_attention,
    xkv_decode_reference,
)


def _inputs(b=1, hq=6, hk=2, d=16, length=37, rk=5, rv=7, tail=3, seed=0):
    rng = np.random.default_rng(seed)
    n = lambda s, c=1.0: jnp.asarray(c * rng.standard_normal(s, np.float32))
    return dict(
        q=n((b, hq, d)), key_factor=n((b, length, rk)), key_basis=n((b, hk, rk, d), 0.3),
        value_factor=n((b, length, rv)), value_basis=n((b, hk, rv, d)),
        tail_keys=n((b, tail, hk, d)), tail_values=n((b, tail, hk, d)),
    )


def test_kernel_matches_reference_odd_sizes_interpret():
    # non-default BlockSizes: L = 37 (not a multiple of the 8-token block), 3 splits, GQA 3,
    # odd ranks, partial tail
    x = _inputs()
    ref = xkv_decode_reference(**x, rope_theta=1e4, tail_length=2)
    out = xkv_decode_attention(**x, rope_theta=1e4, tail_length=2, implementation="pallas",
                               interpret=True, block_sizes=BlockSizes(block_k=8, num_splits=3))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_block_sizes_are_checked():
    with pytest.raises(ValueError, match=r"BlockSizes.block_k=12 must be a power of two >= 8"):
        BlockSizes(block_k=12)
    with pytest.raises(ValueError, match=r"BlockSizes.num_splits=0 must be a positive int"):
        BlockSizes(num_splits=0)
    with pytest.raises(ValueError, match=r"xkv_decode_attention: block_sizes="):
        xkv_decode_attention(**_inputs(), rope_theta=1e4, implementation="pallas",
                             interpret=True, block_sizes={"block_k": 8})


def test_latent_value_path_equals_explicit_and_dense_attention():
    x = _inputs(seed=1)
    explicit = xkv_decode_reference(**x, rope_theta=1e4)
    latent = xkv_decode_reference(**x, rope_theta=1e4, value_path="latent")
    np.testing.assert_allclose(latent, explicit, rtol=1e-5, atol=1e-5)
    # against plain attention on the rebuilt, rotated cache with the tail appended
    keys = rope(reconstruct(x["key_factor"], x["key_basis"]), jnp.arange(37), 1e4)
    keys = jnp.concatenate([keys, x["tail_keys"]], axis=1)
    vals = jnp.concatenate([reconstruct(x["value_factor"], x["value_basis"]),
                            x["tail_values"]], axis=1)
    dense = reference_attention(x["q"][:, None], keys, vals, causal=False)[:, 0]
    np.testing.assert_allclose(explicit, dense, rtol=1e-5, atol=1e-5)


def test_shifting_all_positions_leaves_scores_unchanged():
    # RoPE is relative: q·RoPE(k, t) with q at p equals q'·RoPE(k, t+s) with q' at p+s
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 6, 1, 8), np.float32))
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 8), np.float32))
    score = lambda shift: jnp.einsum(
        "bqhd,bthd->t", rope(q, jnp.array([10 + shift]), 1e4),
        rope(x, jnp.arange(6) + shift, 1e4))
    np.testing.assert_allclose(score(0), score(57), rtol=1e-4, atol=1e-4)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_shapes_and_implementation_raise():
    x = _inputs(b=1, length=5)
    with pytest.raises(ValueError, match="implementation"):
        xkv_decode_attention(**x, rope_theta=1e4, implementation="cuda")
    bad = dict(x, key_basis=x["key_basis"][..., :-1])
    with pytest.raises(ValueError, match="key_basis"):
        xkv_decode_attention(**bad, rope_theta=1e4)


def test_triton_lowering_at_production_sizes():
    # Pallas -> Triton lowering runs on CPU (no device): bf16, Hq=32, H_kv=8, D=128, xKV-4 ranks
    from jax import export
    from jax.experimental.pallas import triton as pl_triton
    from jax.sharding import AbstractDevice, AbstractMesh

    from pallas_kernels.xkv_decode import xkv_decode_partials

    shape = jax.ShapeDtypeStruct
    args = (shape((2, 32, 128), jnp.bfloat16), shape((2, 4096, 384), jnp.bfloat16),
            shape((2, 8, 384, 128), jnp.bfloat16), shape((2, 4096, 576), jnp.bfloat16))
    params = pl_triton.CompilerParams(num_warps=4, num_stages=2)
    fn = jax.jit(lambda q, ak, bk, av: xkv_decode_partials(
        q, ak, bk, av, rope_theta=1e7, scale=128 ** -0.5, block_k=64, num_splits=8,
        compiler_params=params))
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(fn, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xkv_decode" in exported.mlir_module()
    assert exported.out_avals[0].shape == (2, 8, 4, 576)
