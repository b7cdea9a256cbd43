"""UniSVQ with per-group ``A``/``b``: one group is the per-matrix version, groups follow row scales,
the closed-form lattice refit, the dense decode and the storage accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.quant.packing import unisvq_bits_per_weight
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    UniSVQWeight,
    decode_grouped,
    dequantize,
    hessian,
    initial_lattice,
    proxy_loss,
    quantize_linear,
    quantize_linear_grouped,
    random_orthogonal,
    refit_lattice,
    rotate_problem,
)
from pallas_kernels.lattice_matmul.reference import decode_codes

CFG = UniSVQConfig(hadamard_block=8, tune_iters=2)


def _problem(m=32, n=32, seed=0, scales=None):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    w = jax.random.normal(k1, (m, n))
    if scales is not None:  # one scale per block of m / len(scales) rows
        w = w * jnp.repeat(jnp.asarray(scales, jnp.float32), m // len(scales))[:, None]
    x = jax.random.normal(k2, (256, n)) * jnp.linspace(0.3, 2.0, n)
    return w, hessian(x)


def test_one_group_equals_the_per_matrix_quantizer():
    w, h = _problem()
    glob = quantize_linear(w, h, CFG)
    grouped = quantize_linear_grouped(w, h, CFG, groups=1)
    assert grouped.affine.shape == (1, 4, 4) and grouped.offset.shape == (1, 4)
    np.testing.assert_array_equal(np.asarray(grouped.codes), np.asarray(glob.codes))
    np.testing.assert_allclose(grouped.affine[0], glob.affine, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grouped.offset[0], glob.offset, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dequantize(grouped), dequantize(glob), rtol=1e-4, atol=1e-5)
    assert grouped.bits_per_weight() == glob.bits_per_weight() == unisvq_bits_per_weight(32, 32)


def test_groups_that_follow_block_scales_have_lower_error():
    # rows of output Hadamard block g (8 rows, hadamard_block=8) scaled by 4**g: the rotation mixes
    # rows only inside a block, so the rotated weight keeps the 4 group scales
    w, h = _problem(scales=[1.0, 4.0, 16.0, 64.0])
    err_global = float(proxy_loss(w, dequantize(quantize_linear(w, h, CFG)), h))
    err_groups = float(proxy_loss(w, dequantize(quantize_linear_grouped(w, h, CFG, groups=4)),
                                  h))
    assert err_groups < 0.5 * err_global
    # on a weight without group structure, the extra lattices change little either way
    w1, _ = _problem(seed=1)
    e1 = float(proxy_loss(w1, dequantize(quantize_linear(w1, h, CFG)), h))
    e4 = float(proxy_loss(w1, dequantize(quantize_linear_grouped(w1, h, CFG, groups=4)), h))
    assert abs(e4 - e1) < 0.25 * e1


def test_group_scale_is_the_rms_of_the_rotated_rows():
    w, h = _problem(scales=[1.0, 3.0])
    q = quantize_linear_grouped(w, h, CFG, groups=2)
    w_rot, *_ = rotate_problem(w, h, jax.random.PRNGKey(CFG.seed), 8, 8)
    rms = np.sqrt(np.mean(np.asarray(w_rot).reshape(2, -1) ** 2, axis=1))
    a0, b0 = initial_lattice(random_orthogonal(jax.random.split(jax.random.PRNGKey(0), 3)[2]))
    for g in range(2):
        np.testing.assert_allclose(q.affine[g], rms[g] * a0, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(q.offset[g], rms[g] * b0, rtol=1e-5, atol=1e-6)


def test_refit_recovers_the_lattice_that_made_the_weight():
    key = jax.random.PRNGKey(3)
    k1, k2, k3 = jax.random.split(key, 3)
    m, n, groups = 12, 16, 3
    codes = jax.random.randint(k1, (m, n // 4), 0, 256).astype(jnp.uint8)
    affine = jax.random.normal(k2, (groups, 4, 4))
    offset = jax.random.normal(k3, (groups, 4))
    w = decode_grouped(codes, affine, offset)
    _, h = _problem(m=8, n=n)
    for hess in (None, h):
        a_fit, b_fit = refit_lattice(w, hess, codes, jnp.zeros_like(affine),
                                     jnp.zeros_like(offset), ridge=1e-9)
        np.testing.assert_allclose(a_fit, affine, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(b_fit, offset, rtol=1e-3, atol=1e-3)


def test_refit_never_raises_the_hessian_weighted_error_for_fixed_codes():
    w, h = _problem(scales=[1.0, 2.0, 0.5, 1.5])
    q = quantize_linear_grouped(w, h, CFG, groups=4)
    w_rot, w_scale, _, _, h_rot = rotate_problem(w, h, jax.random.PRNGKey(CFG.seed), 8, 8)

    def err(a, b):
        e = decode_grouped(q.codes, a, b) - w_rot
        return float(jnp.sum((e @ h_rot) * e))

    a_fit, b_fit = refit_lattice(w_rot, h_rot, q.codes, q.affine, q.offset)
    before, after = err(q.affine, q.offset), err(a_fit, b_fit)
    assert after <= before * (1 + 1e-5)
    # it is the optimum: a small move of any coordinate does not lower it
    for idx in [(0, 0, 0), (2, 3, 1)]:
        for eps in (1e-3, -1e-3):
            assert err(a_fit.at[idx].add(eps), b_fit) >= after * (1 - 1e-5)
    # and the quantizer's refit option lowers the proxy loss of the dense weight
    refit = quantize_linear_grouped(w, h, UniSVQConfig(hadamard_block=8, tune_iters=2,
                                                       lattice_refit=2), groups=4)
    assert float(proxy_loss(w, dequantize(refit), h)) <= float(proxy_loss(w, dequantize(q), h))


def test_decode_grouped_matches_per_matrix_decode_per_group():
    key = jax.random.PRNGKey(5)
    codes = jax.random.randint(key, (8, 3), 0, 256).astype(jnp.uint8)
    a, b = jax.random.normal(key, (2, 4, 4)), jax.random.normal(key, (2, 4))
    dense = decode_grouped(codes, a, b)
    for g in range(2):
        np.testing.assert_allclose(dense[4 * g:4 * g + 4],
                                   decode_codes(codes[4 * g:4 * g + 4], a[g], b[g]), atol=1e-6)


def test_grouped_accounting_and_validation():
    w, h = _problem()
    q = quantize_linear_grouped(w, h, CFG, groups=8)
    assert q.groups == 8
    assert q.bits_per_weight() == unisvq_bits_per_weight(32, 32) + 16 * 20 * 7 / (32 * 32)
    via_cfg = quantize_linear(w, h, UniSVQConfig(hadamard_block=8, tune_iters=2,
                                                 affine_groups=8))
    np.testing.assert_array_equal(np.asarray(via_cfg.codes), np.asarray(q.codes))
    one = quantize_linear(w, h, UniSVQConfig(hadamard_block=8, lattice_refit=1))
    assert one.affine.shape == (4, 4) and isinstance(one, UniSVQWeight)
    with pytest.raises(ValueError, match="divide"):
        quantize_linear_grouped(w, h, CFG, groups=5)
    with pytest.raises(ValueError, match="affine_groups"):
        UniSVQConfig(affine_groups=0)


def test_codebook_arms_store_one_lattice_per_group_and_simulate_in_place():
    from flax import nnx

    from lowrank_jax.models.llama import Llama, LlamaConfig
    from lowrank_jax.quant.codebooks import codebook_arm
    from lowrank_jax.quantize.pipeline import dequantized_projections

    w = jax.random.normal(jax.random.PRNGKey(0), (32, 32))
    key = jax.random.PRNGKey(1)
    w1, bpw1 = codebook_arm("unisvq2", w, None, CFG, key)
    w2, bpw2 = codebook_arm("unisvq2-blocks", w, None, CFG, key)  # G = 32 / 8 = 4 lattices
    assert bpw1 == unisvq_bits_per_weight(32, 32)
    assert bpw2 == pytest.approx(bpw1 + 3 * 20 * 16 / (32 * 32))
    eye = jnp.eye(32)
    assert float(proxy_loss(w, w2, eye)) < float(proxy_loss(w, w1, eye)) < 0.2
    with pytest.raises(ValueError, match="unknown"):
        codebook_arm("unisvq5", w, None, CFG, key)

    model = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=2,
                              d_ff=16), rngs=nnx.Rngs(0))
    before, other = (model.layers[i].mlp.up_proj.kernel[...] for i in (1, 0))
    with dequantized_projections(model, [1], lambda i, name, w: (jnp.round(w), 4.0)) as done:
        np.testing.assert_array_equal(model.layers[1].mlp.up_proj.kernel[...], jnp.round(before))
        np.testing.assert_array_equal(model.layers[0].mlp.up_proj.kernel[...], other)
    assert sorted(done) == sorted((1, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"))
    np.testing.assert_array_equal(model.layers[1].mlp.up_proj.kernel[...], before)  # restored
