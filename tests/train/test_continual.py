"""ACC / BWT / FWT on hand-computed accuracy matrices."""

import numpy as np
import pytest

from lowrank_jax.train.continual import continual_metrics


def test_metrics_known_values():
    r = [[0.9, 0.1, 0.2],
         [0.7, 0.8, 0.3],
         [0.6, 0.5, 0.9]]
    m = continual_metrics(r, baseline=[0.1, 0.1, 0.1])
    np.testing.assert_allclose(m.acc, (0.6 + 0.5 + 0.9) / 3)
    np.testing.assert_allclose(m.bwt, ((0.6 - 0.9) + (0.5 - 0.8)) / 2)
    np.testing.assert_allclose(m.fwt, ((0.1 - 0.1) + (0.3 - 0.1)) / 2)
    assert continual_metrics(np.eye(3)).fwt is None


def test_no_forgetting_has_zero_bwt_and_bad_shapes_fail():
    r = np.tril(np.ones((4, 4)))
    assert continual_metrics(r).bwt == 0.0
    with pytest.raises(ValueError, match="square"):
        continual_metrics(np.ones((2, 3)))
    with pytest.raises(ValueError, match="one accuracy per task"):
        continual_metrics(np.eye(2), baseline=[0.1])
