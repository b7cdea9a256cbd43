"""BaLoRA's synthetic study (Castin et al, Fig. 3), reduced grid: beats LoRA, stays balanced.

Runs the study of ``lowrank_jax.optim.balora_synthetic`` (what
``scripts/reproduce/balora_synthetic.py`` runs) with 4 seeds × 16 learning rates (the full
run uses 8 × 50). Measured on 2026-11-29: median final excess loss 0.35 (BaLoRA) vs 1.15 (LoRA),
BaLoRA's balancing gap <= 1.6e-5 after every step, LoRA's 45.8 at step 0, 54.9 at its peak, 48.6 at
the end.
"""

import numpy as np
import pytest

from lowrank_jax.optim import balora_synthetic

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("optim.test_balora_synthetic")


@pytest.fixture(scope="module")
def study():
    module = balora_synthetic
    return module, module.run_study(seeds=4, lrs=np.linspace(1e-5, 0.3, 16), steps=100)


def test_optimal_loss_is_eckart_young(study):
    module, _ = study
    problems = module.make_problems(2, n=6, m=5, rank=2, resample_problem=True)
    residual = np.asarray(problems.target[0] - problems.w0[0], np.float64)
    u, s, vt = np.linalg.svd(residual)
    best = residual - (u[:, :2] * s[:2]) @ vt[:2]  # what the best rank-2 correction leaves
    got = float(module.optimal_loss(problems.w0, problems.target, 2)[0])
    assert got == pytest.approx(0.5 * np.sum(best**2), rel=1e-5)


def test_no_run_goes_below_the_optimum(study):
    _, res = study
    for r in res["methods"].values():
        assert np.min(r["excess"]) > -1e-3 * np.max(res["l_star"])


def test_balora_beats_lora_final_excess(study):
    _, res = study
    lora = np.median(res["methods"]["LoRA"]["excess"][:, -1])
    balora = np.median(res["methods"]["BaLoRA"]["excess"][:, -1])
    assert balora < 0.6 * lora, (balora, lora)


def test_balora_balanced_lora_not(study):
    _, res = study
    lora_gap = np.median(res["methods"]["LoRA"]["gap"], axis=0)
    balora_gap = res["methods"]["BaLoRA"]["gap"]
    assert np.max(balora_gap[:, 1:]) < 1e-3  # projected after every step (fp32 round-off ~1e-5)
    assert lora_gap[0] > 10.0  # L = 0, R ~ N(0, 1): ‖R Rᵀ‖_F
    assert np.max(lora_gap) > 1.1 * lora_gap[0]  # LoRA's imbalance grows ...
    assert lora_gap[-1] > 1.03 * lora_gap[0]  # ... and is still above its start at the end
