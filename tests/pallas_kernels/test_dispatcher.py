"""The attention dispatcher owns registration; kernels stand alone; tests leave no entries."""

import ast
import pathlib

import jax
import numpy as np
import pytest

import pallas_kernels
from lowrank_jax.attention import (
    available,
    get_attention,
    reference_attention,
    register_attention,
    unregister_attention,
)
from pallas_kernels.flash_attention.reference import attention_reference

_PROBE = "leak_probe_for_test"


def test_kernels_never_import_the_library():
    root = pathlib.Path(pallas_kernels.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 10
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "lowrank_jax"]
    assert offenders == []


def test_one_attention_reference():
    assert reference_attention is attention_reference
    assert get_attention("reference") is attention_reference


def test_register_then_unregister():
    fn = lambda q, k, v, **_: q  # noqa: E731
    register_attention(_PROBE, fn)
    assert get_attention(_PROBE) is fn
    unregister_attention(_PROBE)
    assert _PROBE not in available()
    with pytest.raises(ValueError, match="not registered"):
        unregister_attention(_PROBE)
    with pytest.raises(ValueError, match="reference"):
        unregister_attention("reference")


def test_a_test_may_register_an_entry():
    register_attention(_PROBE, lambda q, k, v, **_: q)  # left behind on purpose
    assert _PROBE in available()


def test_the_entry_of_the_previous_test_is_gone():
    # Runs after the test above (file order): the conftest fixture restored the registry.
    assert _PROBE not in available()


def test_flash_entry_falls_back_to_reference_for_decode():
    q = jax.random.normal(jax.random.key(0), (1, 1, 2, 16))
    k = v = jax.random.normal(jax.random.key(1), (1, 6, 1, 16))
    got = get_attention("flash")(q, k, v, causal=True, q_offset=5, kv_length=4)
    want = reference_attention(q, k, v, causal=True, q_offset=5, kv_length=4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- one meaning


def test_implementation_and_interpret_mean_the_same_everywhere():
    from pallas_kernels._dispatch import has_accelerator, resolve

    assert resolve("xla", None) == ("xla", False)
    assert resolve("auto", True) == ("pallas", True)
    assert resolve("pallas", True) == ("pallas", True)
    if not has_accelerator():
        assert resolve("auto", None) == ("xla", False)
        assert resolve("pallas", None) == ("pallas", True)
        with pytest.raises(ValueError, match="interpret=False"):
            resolve("pallas", False)
    with pytest.raises(ValueError, match="implementation='fast' is unknown"):
        resolve("fast", None)


def test_inference_only_kernels_refuse_gradients_clearly():
    import jax.numpy as jnp

    from pallas_kernels.lattice_matmul.api import code_matmul
    from pallas_kernels.sparse_attention.api import sale_prefill_attention
    from pallas_kernels.sparse_attention.reference import SaleConfig
    from pallas_kernels.xkv_decode.api import xkv_decode_attention

    codes = jnp.full((3, 2), 0b00011011, jnp.uint8)
    lattice = lambda x: code_matmul(x, codes, jnp.eye(4), jnp.zeros(4), interpret=True).sum()
    np.testing.assert_allclose(lattice(jnp.ones((1, 8))), 36.0)  # forward still works
    cfg = SaleConfig(block_q=16, block_k=16, block_seg=16, local_window=16, dense_below=0)
    q = jax.random.normal(jax.random.key(0), (1, 32, 2, 16))
    kv = jax.random.normal(jax.random.key(1), (1, 32, 1, 16))
    sale = lambda q: sale_prefill_attention(q, kv, kv, 0.01, cfg, implementation="pallas",
                                            interpret=True).sum()
    factors = (jnp.ones((1, 5, 3)), jnp.ones((1, 2, 3, 8)), jnp.ones((1, 5, 3)),
               jnp.ones((1, 2, 3, 8)))
    xkv = lambda q: xkv_decode_attention(q, *factors, rope_theta=1e4, implementation="pallas",
                                         interpret=True).sum()
    for name, fn, x in (("code_matmul", lattice, jnp.ones((1, 8))),
                        ("sale_prefill_attention", sale, q),
                        ("xkv_decode_attention", xkv, jnp.ones((1, 4, 8)))):
        with pytest.raises(ValueError, match=f"{name}: the Pallas kernel is inference-only"):
            jax.grad(fn)(x)


def test_grouped_lora_blocks_that_cannot_tile_raise():
    import jax.numpy as jnp

    from pallas_kernels.grouped_lora.api import BlockSizes, lora_expand, lora_shrink

    sizes, ranks = jnp.array([2, 2]), jnp.array([2, 2])
    x, a = jnp.ones((4, 24)), jnp.ones((2, 24, 4))
    with pytest.raises(ValueError, match=r"block_k=16 does not tile d_in=24"):
        lora_shrink(x, a, sizes, jnp.ones(2), ranks, interpret=True,
                    block_sizes=BlockSizes(block_k=16))
    with pytest.raises(ValueError, match=r"block_r=16 does not tile the padded rank R=24"):
        lora_shrink(x, jnp.ones((2, 24, 24)), sizes, jnp.ones(2), ranks, interpret=True)
    with pytest.raises(ValueError, match=r"d_in=1030 has no power-of-two tile"):
        lora_shrink(jnp.ones((4, 1030)), jnp.ones((2, 1030, 4)), sizes, jnp.ones(2), ranks,
                    interpret=True)
    with pytest.raises(ValueError, match=r"block_n=16 does not tile d_out=24"):
        lora_expand(jnp.ones((4, 4)), jnp.ones((2, 4, 24)), sizes, ranks, interpret=True,
                    block_sizes=BlockSizes(block_n=16))
    # a default block that fits: d_in = 24 -> block_k = 8, same result as the reference
    got = lora_shrink(x, a, sizes, jnp.ones(2), ranks, interpret=True)
    want = lora_shrink(x, a, sizes, jnp.ones(2), ranks, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
