"""train.class_incremental: the stream's structure, the masked cosine logits, and the claim of the
benchmark at tiny size (Janus keeps the first layer's change off past inputs, plain LoRA doesn't).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.train import class_incremental as ci


def test_stream_is_deterministic_and_each_task_spans_its_subspace():
    data = ci.make_stream(3, n_per_class=6)
    again = ci.make_stream(3, n_per_class=6)
    assert len(data) == ci.TASKS
    np.testing.assert_array_equal(data[2][0][0], again[2][0][0])
    for t, ((x, y), (x_test, y_test)) in enumerate(data):
        assert x.shape == (ci.CLASSES_PER_TASK * 6, ci.D_IN) and x_test.shape == x.shape
        assert set(y.tolist()) | set(y_test.tolist()) == set(
            range(t * ci.CLASSES_PER_TASK, (t + 1) * ci.CLASSES_PER_TASK))
        s = np.linalg.svd(np.concatenate([x, x_test]), compute_uv=False)
        assert s[ci.SUB] < 1e-4 * s[0]  # every point lies in the task's SUB-dim subspace


def test_logits_mask_unseen_classes_and_start_at_the_frozen_model():
    params = ci.init_params(0)
    x = jnp.asarray(ci.make_stream(0, n_per_class=2)[0][0][0])
    seen = np.arange(ci.TASKS * ci.CLASSES_PER_TASK) < ci.CLASSES_PER_TASK
    logits = jax.jit(ci.logits_fn)(params, x, seen)
    assert np.all(np.asarray(logits)[:, ~seen] == -1e9)
    assert np.all(np.abs(np.asarray(logits)[:, seen]) <= ci.TEMP + 1e-4)  # cosines times TEMP
    frozen = np.asarray(x) @ np.asarray(params["l1"]["kernel"])  # lora_b = 0: W only
    np.testing.assert_allclose(jax.jit(ci.layer)(params["l1"], x), frozen, rtol=1e-5, atol=1e-5)


def test_lora_run_fills_the_lower_triangle_and_reports_its_summary():
    data = ci.make_stream(0, n_per_class=4)
    r = ci.run_method("lora", data, 0, steps=2, lr=3e-3, batch=8)
    matrix = np.asarray(r["matrix"])
    assert np.all(np.triu(matrix, 1) == 0) and np.all((matrix >= 0) & (matrix <= 1))
    np.testing.assert_allclose(r["acc"], matrix[-1].mean())
    np.testing.assert_allclose(r["bwt"], np.mean([matrix[-1, j] - matrix[j, j]
                                                  for j in range(ci.TASKS - 1)]))
    assert r["violation_l1"] > 0  # plain LoRA moves the first layer on past inputs


@pytest.mark.slow
def test_janus_protects_past_inputs_plain_lora_does_not():
    data = ci.make_stream(0, n_per_class=8)
    runs = {m: ci.run_method(m, data, 0, steps=4, lr=3e-3, batch=16) for m in ("lora", "janus")}
    for r in runs.values():
        assert 0.0 <= r["acc"] <= 1.0 and np.shape(r["matrix"]) == (ci.TASKS, ci.TASKS)
    assert runs["janus"]["violation_l1"] < 0.05 * runs["lora"]["violation_l1"]
