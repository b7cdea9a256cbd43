"""Janus' protected bases carried in the optimizer state, and the A-only projection baseline."""

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.core.step import make_step
from lowrank_jax.optim import janus, scale_by_input_projection, set_subspaces, with_subspaces

K = jax.random.split(jax.random.key(0), 4)
PARAMS = {"l": {"lora_a": jax.random.normal(K[0], (6, 2)),
                "lora_b": jax.random.normal(K[1], (2, 3))}}
GRADS = {"l": {"lora_a": jax.random.normal(K[2], (6, 2)),
               "lora_b": jax.random.normal(K[3], (2, 3))}}
V = jnp.linalg.qr(jax.random.normal(jax.random.key(5), (6, 2)))[0]


def test_with_subspaces_equals_the_extra_argument():
    inner = janus(1e-2)
    want, _ = inner.update(GRADS, inner.init(PARAMS), PARAMS, subspaces={"l": V})
    tx = with_subspaces(janus(1e-2))
    got, state = tx.update(GRADS, set_subspaces(tx.init(PARAMS), {"l": V}), PARAMS)
    np.testing.assert_array_equal(got["l"]["lora_a"], want["l"]["lora_a"])
    np.testing.assert_array_equal(got["l"]["lora_b"], want["l"]["lora_b"])
    assert set(state.subspaces) == {"l"}


def test_make_step_with_subspaces_keeps_protected_outputs():
    """Through the one step: outputs of inputs in span(V) do not move."""
    x = jnp.ones((4, 6))
    loss = lambda p, x: jnp.sum((x @ p["l"]["lora_a"] @ p["l"]["lora_b"] - 1.0) ** 2)  # noqa: E731
    tx = with_subspaces(janus(1e-1))
    step = make_step(loss, tx)
    params, state, _ = step(PARAMS, set_subspaces(tx.init(PARAMS), {"l": V}), x)
    before = V.T @ PARAMS["l"]["lora_a"] @ PARAMS["l"]["lora_b"]
    after = V.T @ params["l"]["lora_a"] @ params["l"]["lora_b"]
    np.testing.assert_allclose(after, before, atol=1e-5)
    moved = params["l"]["lora_a"] @ params["l"]["lora_b"] - PARAMS["l"]["lora_a"] @ PARAMS["l"][
        "lora_b"]
    assert float(jnp.abs(moved).max()) > 1e-3  # the adapter did train, outside span(V)


def test_input_projection_projects_a_only():
    tx = scale_by_input_projection()
    u, _ = tx.update(GRADS, tx.init(PARAMS), PARAMS, subspaces={"l": V})
    np.testing.assert_allclose(u["l"]["lora_a"],
                               GRADS["l"]["lora_a"] - V @ (V.T @ GRADS["l"]["lora_a"]),
                               atol=1e-6)
    np.testing.assert_allclose(V.T @ u["l"]["lora_a"], 0.0, atol=1e-6)
    np.testing.assert_array_equal(u["l"]["lora_b"], GRADS["l"]["lora_b"])
