"""federated.synthetic.deep_linear_study: untrained strategies agree, training lowers the MSE."""

import numpy as np

from lowrank_jax import federated as fed
from lowrank_jax.federated import synthetic


def test_study_rows_and_a_zero_learning_rate_baseline():
    frozen = synthetic.deep_linear_study({"fedavg": fed.FedAvgLoRA(), "local": fed.LocalOnly()},
                                         rounds=2, local_steps=1, learning_rate=0.0, last=2)
    assert set(frozen) == {"fedavg", "local"} and frozen["local"]["depths"] == []
    np.testing.assert_allclose(frozen["fedavg"]["mse"], frozen["local"]["mse"], rtol=1e-6)
    trained = synthetic.deep_linear_study({"local": fed.LocalOnly()}, rounds=2, local_steps=3,
                                          learning_rate=1e-2, last=1)
    assert trained["local"]["mse"][0] < frozen["local"]["mse"][0]
