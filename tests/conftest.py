"""Test setup: 8 simulated CPU devices (before JAX starts) and shared fixtures."""

import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
