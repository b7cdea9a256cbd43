"""The baselines UniSVQ is measured against: standard RTN (integer zero-point), the scalar
RHT + LDLQ 2-bit quantizer, k-means VQ as a fine-tunable layer; the pipeline's no-FT snapshot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.quant.kmeans_vq import kmeans_vq_quantize, kmeans_vq_weight, vq_dequantize
from lowrank_jax.quant.layers import VQLinear
from lowrank_jax.quantize import load_quantized, quantize_model, save_quantized
from lowrank_jax.quantize.pipeline import unfinetuned_model
from lowrank_jax.quant.packing import rtn_bits_per_weight, storage_bits
from lowrank_jax.quant.rtn import rtn_dequantize, rtn_from_arrays, rtn_quantize, rtn_to_arrays
from lowrank_jax.quant.scalar_ldlq import (
    dividing_sq_group,
    group_scales,
    sq_bits_per_weight,
    sq_ldlq_quantize,
)
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    initial_lattice,
    make_grid,
    proxy_loss,
    rht,
    random_signs,
)


def test_integer_zero_point_known_answer():
    # 2 bits, one group: lo=-1, hi=2.5 -> s = 3.5/3 (fp16), 0 is NOT on the float grid lo + k·s
    w = jnp.array([[-1.0, 0.0, 0.0, 2.5]])
    s = float(np.float16(3.5 / 3))
    q = rtn_quantize(w, 2, 4, zero_point="integer")
    assert int(q.zero[0, 0]) == 1  # round(1/s) = round(0.857)
    assert q.codes.tolist() == [[0, 1, 1, 3]]
    np.testing.assert_allclose(rtn_dequantize(q), [[-s, 0.0, 0.0, 2 * s]], rtol=0, atol=1e-7)
    assert float(rtn_dequantize(q)[0, 1]) == 0.0  # zero is exactly representable
    f = rtn_quantize(w, 2, 4, zero_point="float")
    assert f.codes.tolist() == [[0, 1, 1, 3]]
    np.testing.assert_allclose(rtn_dequantize(f), [[-1.0, -1 + s, -1 + s, -1 + 3 * s]],
                               atol=1e-6)
    assert abs(float(rtn_dequantize(f)[0, 1])) > 0.16  # the float offset biases the zeros


def test_integer_zero_point_keeps_exact_zeros_and_is_unbiased_on_a_spike():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(32, 128)) * (rng.random((32, 128)) < 0.3)  # 70 % exact zeros
    w = jnp.asarray(w, jnp.float32)
    zeros = np.asarray(w) == 0
    w_int = np.asarray(rtn_dequantize(rtn_quantize(w, 3, 64, "integer")))
    w_flt = np.asarray(rtn_dequantize(rtn_quantize(w, 3, 64, "float")))
    assert np.all(w_int[zeros] == 0.0)
    # float offset: the zeros of a group all move to the same nearest level (a per-group bias)
    assert np.mean(w_flt[zeros] != 0.0) > 0.9
    bias = lambda e: np.abs(e.reshape(32, 2, 64).mean(-1)).mean()  # noqa: E731
    assert bias(w_flt - np.asarray(w)) > 3 * bias(w_int - np.asarray(w))


@pytest.mark.parametrize("zero_point", ["integer", "float"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rtn_storage_round_trip_and_exact_accounting(bits, zero_point):
    m, n, group = 6, 32, 8
    w = jax.random.normal(jax.random.PRNGKey(bits), (m, n))
    q = rtn_quantize(w, bits, group, zero_point)
    arrays = rtn_to_arrays(q)
    assert storage_bits(arrays) == pytest.approx(
        rtn_bits_per_weight(m, n, bits, group, zero_point=zero_point) * m * n)
    back = rtn_from_arrays(arrays, (m, n), bits, group, zero_point)
    np.testing.assert_array_equal(rtn_dequantize(back), rtn_dequantize(q))


def test_rtn_integer_bits_formula_and_bad_zero_point():
    assert rtn_bits_per_weight(576, 576, 3, 64) == 3 + 19 / 64
    assert rtn_bits_per_weight(576, 576, 3, 64, zero_point="float") == 3.5
    with pytest.raises(ValueError, match="zero_point='int8'"):
        rtn_quantize(jnp.ones((2, 8)), 3, 4, zero_point="int8")


def test_scalar_ldlq_plain_rounding_lies_on_the_group_grid():
    key = jax.random.PRNGKey(3)
    w = jax.random.normal(jax.random.PRNGKey(0), (8, 32)) * jnp.linspace(0.5, 2, 32)
    cfg = UniSVQConfig(hadamard_block=8)
    w_hat, bpw = sq_ldlq_quantize(w, None, cfg, group_size=16, key=key)
    assert bpw == sq_bits_per_weight(8, 32, 16) == 3.0
    k_out, k_in, _ = jax.random.split(key, 3)
    s_out, s_in = random_signs(k_out, 8), random_signs(k_in, 32)
    r = rht(w_hat, s_out, s_in, 8, 8)  # back in the rotated basis: s_g · levels
    r_w = rht(w, s_out, s_in, 8, 8)
    w_scale = jnp.sqrt(jnp.mean(r_w * r_w))
    scales = np.asarray(group_scales(r_w / w_scale, 16)) * float(w_scale)
    levels = np.asarray(make_grid(*initial_lattice())[:4, 3])
    ratio = np.asarray(r).reshape(8, 2, 16) / scales[..., None]
    np.testing.assert_allclose(np.min(np.abs(ratio[..., None] - levels), -1), 0, atol=1e-4)


def test_dividing_sq_group_is_the_largest_valid_group_up_to_the_request():
    assert dividing_sq_group(192, [576, 1536]) == 192  # SmolLM2: unchanged
    assert dividing_sq_group(192, [64, 128]) == 64  # the tiny preset
    assert dividing_sq_group(48, [96, 120]) == 24  # gcd 24
    with pytest.raises(ValueError):
        dividing_sq_group(192, [64, 90])  # gcd 2: no multiple of 4


def test_scalar_ldlq_uses_the_hessian_and_bits_match_unisvq():
    rng = np.random.default_rng(0)
    losses = []
    for seed in range(3):
        w = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
        x = rng.normal(size=(256, 64)) @ rng.normal(size=(64, 64))  # correlated inputs
        h = jnp.asarray(x.T @ x / 256 + 1e-2 * np.eye(64), jnp.float32)
        cfg = UniSVQConfig(hadamard_block=16, tune_iters=2)
        plain, _ = sq_ldlq_quantize(w, None, cfg, group_size=16)
        ldlq, _ = sq_ldlq_quantize(w, h, cfg, group_size=16)
        losses.append((float(proxy_loss(w, plain, h)), float(proxy_loss(w, ldlq, h))))
    plain, ldlq = np.mean(losses, axis=0)
    assert ldlq < 0.8 * plain
    assert abs(sq_bits_per_weight(576, 1536, 192) - 2.0466) < 0.1  # matched to UniSVQ's bpw
    with pytest.raises(ValueError, match="group_size=10"):
        sq_ldlq_quantize(w, None, cfg, group_size=10)


def test_vq_linear_equals_dense_dequantized_and_trains_its_codebook():
    w = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    q = kmeans_vq_weight(w, None, UniSVQConfig(hadamard_block=32), iters=3)
    layer = VQLinear(q)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 64))
    np.testing.assert_allclose(layer(x), x @ vq_dequantize(q).T, atol=1e-5)
    w_hat, bpw = kmeans_vq_quantize(w, None, UniSVQConfig(hadamard_block=32), iters=3)
    np.testing.assert_allclose(w_hat, vq_dequantize(q), atol=1e-6)
    assert bpw == pytest.approx(2 + 16 * (256 * 4 + 96) / (32 * 64))
    grads = nnx.grad(lambda lay: jnp.sum(lay(x) ** 2))(layer)
    assert float(jnp.abs(grads["codebook"][...]).sum()) > 0


def _tiny():  # every projection 32×32: one compiled shape
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=32,
                      max_seq_len=32)
    return Llama(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_kmeans_and_scalar_methods_in_the_pipeline_and_no_ft_snapshot(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, (8, 16))
    probe = jnp.asarray(tokens[:2])
    cfg = UniSVQConfig(tune_iters=1, finetune_steps=6, lr_scale=1e-2, lr_affine=1e-2)
    model = _tiny()
    report = quantize_model(model, tokens, method="kmeans", cfg=cfg, keep_unfinetuned=True,
                            progress=False, layers=[1])
    assert isinstance(model.layers[1].mlp.up_proj, VQLinear)
    assert all(b["val_mse_after"] <= b["val_mse_before"] for b in report["blocks"])
    # restoring the snapshot gives exactly the no-fine-tuning model
    ref = _tiny()
    quantize_model(ref, tokens, method="kmeans", cfg=UniSVQConfig(tune_iters=1,
                   finetune_steps=0), progress=False, layers=[1])
    tuned = model(probe)[0]
    snap = unfinetuned_model(model, report)
    np.testing.assert_allclose(snap(probe)[0], ref(probe)[0], atol=1e-5)
    np.testing.assert_array_equal(model(probe)[0], tuned)  # the fine-tuned model is unchanged
    save_quantized(model, tmp_path / "vq", report=report)
    loaded, _ = load_quantized(tmp_path / "vq")
    np.testing.assert_allclose(loaded(probe)[0], model(probe)[0], atol=1e-4)

    sq = _tiny()
    rep = quantize_model(sq, tokens, method="sq-ldlq", sq_group_size=16, cfg=cfg,
                         progress=False)
    assert rep["bits_per_weight"] == pytest.approx(2 + 16 / 16)
    assert isinstance(sq.layers[0].mlp.up_proj, nnx.Linear)


def test_kmeans_segment_sum_matches_lloyd_reference_and_subsample_fits_blobs():
    from lowrank_jax.quant.kmeans_vq import codebook_kmeans

    rng = np.random.default_rng(0)
    centres = np.array([[4.0, 0, 0, 0], [0, 4.0, 0, 0], [0, 0, 4.0, 0], [0, 0, 0, 4.0]])
    v = (centres[rng.integers(0, 4, 4000)] + 0.1 * rng.normal(size=(4000, 4))).astype(np.float32)
    key = jax.random.PRNGKey(3)
    got = np.asarray(codebook_kmeans(jnp.asarray(v), key, centroids=4, iters=5))
    # numpy Lloyd from the same start (the function's init: a sample of the vectors)
    k_init, _ = jax.random.split(key)
    c = v[np.asarray(jax.random.choice(k_init, 4000, (4,), replace=False))].copy()
    for _ in range(5):
        idx = np.argmin(((v[:, None] - c[None]) ** 2).sum(-1), axis=1)
        c = np.stack([v[idx == k].mean(0) if np.any(idx == k) else c[k] for k in range(4)])
    np.testing.assert_allclose(got, c, atol=1e-4)
    # a fit on a 2k subsample of 20k Gaussian 4-vectors quantizes all of them about as well
    g = jax.random.normal(jax.random.PRNGKey(4), (20000, 4))

    def mse(c):
        return float(jnp.mean(jnp.min(((g[:, None] - c[None]) ** 2).sum(-1), axis=1)))

    full = mse(codebook_kmeans(g, key, centroids=16, iters=10))
    sub = mse(codebook_kmeans(g, key, centroids=16, iters=10, sample=2000))
    assert sub < 1.1 * full
    assert full < 0.5 * 4  # far below the data variance (a real fit, not the init)
