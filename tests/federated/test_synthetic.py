"""The squared-error objective and the deep-linear synthetic study's planted structure."""

import numpy as np
import pytest

from lowrank_jax import federated as fed
from lowrank_jax.federated import fedtreelora as tree
from lowrank_jax.federated import synthetic
from lowrank_jax.federated.simulator import squared_error


def test_squared_error_known_value():
    out = np.array([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]], np.float32)
    target = np.array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], np.float32)
    loss, acc = squared_error(out, target, np.array([1.0, 1.0, 0.0], np.float32))
    assert float(loss) == pytest.approx((5.0 + 2.0) / 2)
    assert np.isnan(float(acc))


def test_planted_updates_follow_the_roles():
    model = synthetic.deep_linear_model(d=8, depth=8, rank=2, seed=0)
    assert synthetic.layer_roles(8) == ["shared"] * 3 + ["pairs"] * 3 + ["group"] * 2
    clients, groups = synthetic.make_deep_linear_clients(model, groups=4, per_group=2,
                                                         update_rank=1, n_train=40, n_test=8)
    assert len(clients) == 8 and groups.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # the base kernels are orthogonal, and every client's targets are a linear map of x
    w0 = np.asarray(model.layers[0].kernel[...])
    np.testing.assert_allclose(w0.T @ w0, np.eye(8), atol=1e-5)
    for c in clients:
        x, y = c.train_x.astype(np.float64), c.train_y.astype(np.float64)
        solution, *_ = np.linalg.lstsq(x, y, rcond=None)
        np.testing.assert_allclose(x @ solution, y, atol=1e-3)
    maps = [np.linalg.lstsq(c.train_x, c.train_y, rcond=None)[0] for c in clients]
    same_group = np.linalg.norm(maps[0] - maps[1])
    other_group = np.linalg.norm(maps[0] - maps[2])
    assert same_group < 0.5 * other_group  # only the client noise separates a group


def test_local_warmup_b_similarity_recovers_the_groups():
    model = synthetic.deep_linear_model(seed=0)
    clients, groups = synthetic.make_deep_linear_clients(model, seed=0, n_train=64, n_test=16)
    result = fed.simulate(model, clients, fed.LocalOnly(), rounds=2, local_steps=5,
                          learning_rate=1e-2, loss="mse", progress=False)
    labels = tree.cut(tree.build_tree(tree.client_distance(result.state["clients"])), 4)
    np.testing.assert_array_equal(labels, groups)
    assert np.isnan(result.final["global_accuracy"])
    assert result.history[-1]["personal_loss"] < result.history[0]["personal_loss"]


def test_mse_needs_matching_targets():
    model = synthetic.deep_linear_model(d=8, depth=2, rank=2, seed=0)
    x = np.zeros((4, 8), np.float32)
    client = fed.Client(x, np.zeros((4, 3), np.float32), x, np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match="mse targets"):
        fed.simulate(model, [client], fed.LocalOnly(), rounds=1, loss="mse", progress=False)
    with pytest.raises(ValueError, match="loss="):
        fed.simulate(model, [client], fed.LocalOnly(), rounds=1, loss="l1", progress=False)
    with pytest.raises(ValueError, match="integer labels"):
        fed.simulate(model, [client], fed.LocalOnly(), rounds=1, progress=False)
