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
