"""The end-to-end pass after block-wise quantization: it tunes only continuous parameters (the
codes stay), lowers the held-out calibration KL to the FP model, and keeps the best point."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.presets import preset_model
from lowrank_jax.quantize.e2e import finetune_end_to_end
from lowrank_jax.quant.layers import QuantCodes
from lowrank_jax.quantize.pipeline import quantize_model
from lowrank_jax.quant.unisvq import UniSVQConfig

# its module-scoped fixture is built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("quant.test_e2e")


@pytest.fixture(scope="module")
def _quantized():
    """One quantization for the module (the tests tune clones of it)."""
    fp = preset_model("tiny")
    q = nnx.clone(fp)
    tokens = np.random.default_rng(0).integers(0, fp.cfg.vocab_size, (8, 32)).astype(np.int32)
    quantize_model(q, tokens, method="unisvq", cfg=UniSVQConfig(tune_iters=0, finetune_steps=0),
                   progress=False)
    return fp, q, tokens


def _quantized_pair(quantized):
    fp, q, tokens = quantized
    return fp, nnx.clone(q), tokens


def test_e2e_lowers_the_calibration_kl_and_keeps_codes_and_reference(_quantized):
    fp, q, tokens = _quantized_pair(_quantized)
    codes = [np.asarray(c) for c in jax.tree.leaves(nnx.state(q, QuantCodes))]
    fp_before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(fp))]
    with pytest.raises(ValueError, match="calib_tokens has shape"):
        finetune_end_to_end(q, fp, tokens[:1], steps=1)
    zero = finetune_end_to_end(q, fp, tokens, steps=0)
    assert zero["val_kl_after"] == zero["val_kl_before"] > 0
    info = finetune_end_to_end(q, fp, tokens, steps=12, lr_scale=3e-3, lr_affine=3e-4,
                               lr_norm=3e-3, batch=3)
    assert info["val_kl_before"] == pytest.approx(zero["val_kl_before"], rel=1e-3)
    assert info["val_kl_after"] < 0.98 * info["val_kl_before"]  # measured 0.956
    # the model now holds the returned point (up to the fp16 storage rounding of the floats)
    x = jnp.asarray(tokens[-2:])
    p = jax.nn.log_softmax(fp(x)[0], -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(p) * (p - jax.nn.log_softmax(q(x)[0], -1)), -1)))
    assert kl == pytest.approx(info["val_kl_after"], rel=0.05)
    for a, b in zip(codes, jax.tree.leaves(nnx.state(q, QuantCodes))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fp_before, jax.tree.leaves(nnx.state(fp))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_cached_teacher_logits_give_the_same_pass(_quantized):
    """``cache_teacher`` runs the FP model once instead of every step: the same losses."""
    fp, q, tokens = _quantized_pair(_quantized)
    q2 = nnx.clone(q)
    kw = dict(steps=4, lr_scale=3e-3, lr_affine=3e-4, lr_norm=3e-3, batch=3)
    cached = finetune_end_to_end(q, fp, tokens, cache_teacher=True, **kw)
    live = finetune_end_to_end(q2, fp, tokens, cache_teacher=False, **kw)
    assert [s for s, _ in cached["history"]] == [0, 1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in cached["history"]],
                               [v for _, v in live["history"]], rtol=1e-4)
