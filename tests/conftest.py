"""Test setup: 8 simulated CPU devices (before JAX starts) and shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _attention_registry_is_restored():
    """A test may register attention implementations; none may leak into the next test."""
    from lowrank_jax import attention

    before = dict(attention._IMPLEMENTATIONS)
    yield
    attention._IMPLEMENTATIONS.clear()
    attention._IMPLEMENTATIONS.update(before)
