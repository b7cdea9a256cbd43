"""The setting ``tests/conftest.py`` makes for the suite's speed is in effect (described there,
measured in ``docs/results/test_suite.md``): a JAX release that changed what it patches would
otherwise slow the suite down without a word."""

import os

import jax
from jax._src.interpreters import mlir


def test_programs_lowered_in_one_thread_share_an_mlir_context():
    if os.environ.get("LOWRANK_JAX_TEST_IR_CONTEXT") == "fresh":  # the opt-out: JAX as it is
        assert mlir.make_ir_context.__module__ == "jax._src.interpreters.mlir"
        return
    # three programs in a row: a context is renewed at most once among them (every 256)
    contexts = [jax.jit(lambda x, k=k: x * k + 1).lower(1.0).compiler_ir().context
                for k in (2.0, 3.0, 5.0)]
    assert contexts[0] is contexts[1] or contexts[1] is contexts[2]
    assert mlir.make_ir_context.__module__ != "jax._src.interpreters.mlir"
