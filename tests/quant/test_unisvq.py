"""UniSVQ: lattice, Hadamard rotation, LDLQ, accounting, fine-tuning, model round trip."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.quant.layers import QuantizedLinear, RTNLinear
from lowrank_jax.quantize import (
    load_quantized,
    model_bits_per_weight,
    quantize_model,
    save_quantized,
)
from lowrank_jax.quant.packing import (
    codes_to_words,
    pack_codes,
    storage_bits,
    unisvq_bits_per_weight,
    unpack_codes,
    words_to_codes,
)
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    block_ldl,
    dequantize,
    finetune_block,
    hessian,
    initial_lattice,
    inverse_rht,
    ldlq_quantize,
    make_grid,
    nearest_codeword,
    proxy_loss,
    quantize_linear,
    random_orthogonal,
    random_signs,
    rht,
)
from pallas_kernels.lattice_matmul.reference import block_hadamard, hadamard_matrix

GRID_2BIT = np.array([-1.5, -0.5, 0.5, 1.5]) / np.sqrt(1.25)


def test_bits_per_weight_accounting():
    assert unisvq_bits_per_weight(4096, 4096) == 2 + 16 * 8212 / 4096**2
    assert round(unisvq_bits_per_weight(4096, 4096), 4) == 2.0078
    w = quantize_linear(jax.random.normal(jax.random.PRNGKey(0), (8, 16)), None,
                        UniSVQConfig(hadamard_block=8))
    stored = {"codes": w.codes, "s_in": w.scale_in, "s_out": w.scale_out, "A": w.affine,
              "b": w.offset}
    assert storage_bits(stored) == unisvq_bits_per_weight(8, 16) * 8 * 16
    assert w.bits_per_weight() == unisvq_bits_per_weight(8, 16)


def test_pack_unpack_round_trip_and_digit_order():
    digits = jax.random.randint(jax.random.PRNGKey(1), (5, 8, 4), 0, 4)
    codes = pack_codes(digits)
    assert codes.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_codes(codes), digits)
    assert int(pack_codes(jnp.array([[[1, 2, 3, 0]]]))[0, 0]) == 64 * 1 + 16 * 2 + 4 * 3 + 0
    words = codes_to_words(codes)
    assert words.dtype == jnp.int32 and words.shape == (5, 2)
    np.testing.assert_array_equal(words_to_codes(words), codes)
    first = np.asarray(words).view(np.uint32)[0, 0] >> 24
    assert int(first) == int(codes[0, 0])


def test_initial_lattice_is_uniform_2bit_grid():
    a, b = initial_lattice()
    grid = make_grid(a, b)
    for j in range(4):
        np.testing.assert_allclose(np.unique(np.asarray(grid[:, j])), GRID_2BIT, atol=1e-6)
    # unit variance codewords, and code idx decodes to its own digits
    np.testing.assert_allclose(jnp.mean(grid**2), 1.0, atol=1e-6)
    idx = 64 * 3 + 16 * 0 + 4 * 2 + 1
    np.testing.assert_allclose(grid[idx], GRID_2BIT[[3, 0, 2, 1]], atol=1e-6)
    # nearest codeword with O = I == per-coordinate round to nearest grid level
    w = jax.random.normal(jax.random.PRNGKey(2), (500, 4)) * 1.2
    got = unpack_codes(nearest_codeword(w, grid).astype(jnp.uint8)[:, None])[:, 0]
    per_coord = np.argmin(np.abs(np.asarray(w)[..., None] - GRID_2BIT), axis=-1)
    np.testing.assert_array_equal(np.asarray(got), per_coord)


def test_nearest_codeword_matches_brute_force_rotated_lattice():
    a, b = initial_lattice(random_orthogonal(jax.random.PRNGKey(3)))
    grid = make_grid(a, b)
    w = jax.random.normal(jax.random.PRNGKey(4), (300, 4))
    brute = jnp.argmin(jnp.sum((w[:, None, :] - grid[None]) ** 2, axis=-1), axis=-1)
    np.testing.assert_array_equal(nearest_codeword(w, grid), brute)


@pytest.mark.parametrize("block", [8, 64])
def test_hadamard_orthogonal_and_rht_invertible(block):
    h = hadamard_matrix(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    x = jax.random.normal(jax.random.PRNGKey(5), (3, 64))
    np.testing.assert_allclose(block_hadamard(block_hadamard(x, block), block, transpose=True),
                               x, atol=1e-6)
    w = jax.random.normal(jax.random.PRNGKey(6), (16, 64))
    so, si = random_signs(jax.random.PRNGKey(7), 16), random_signs(jax.random.PRNGKey(8), 64)
    wr = rht(w, so, si, min(block, 16), block)
    np.testing.assert_allclose(jnp.linalg.norm(wr), jnp.linalg.norm(w), rtol=1e-6)
    np.testing.assert_allclose(inverse_rht(wr, so, si, min(block, 16), block), w, atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)


def _correlated_layer(seed=0, m=16, n=32, tokens=2048):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    mix = jax.random.normal(k1, (n, n)) * 0.6 + jnp.eye(n)
    x = jax.random.normal(k2, (tokens, n)) @ mix * jnp.linspace(0.2, 3.0, n)
    return jax.random.normal(k3, (m, n)), x


def test_block_ldl_and_identity_hessian_reduces_to_rounding():
    _, x = _correlated_layer()
    h = hessian(x)
    lower, d = block_ldl(h)
    full_d = jax.scipy.linalg.block_diag(*d)
    np.testing.assert_allclose(lower @ full_d @ lower.T, h, rtol=1e-4, atol=1e-3 * float(h.max()))
    np.testing.assert_allclose(lower.reshape(8, 4, 8, 4)[jnp.arange(8), :, jnp.arange(8)],
                               jnp.broadcast_to(jnp.eye(4), (8, 4, 4)), atol=1e-5)
    a, b = initial_lattice()
    w = jax.random.normal(jax.random.PRNGKey(9), (16, 32))
    np.testing.assert_array_equal(ldlq_quantize(w, jnp.eye(32), a, b, tune_iters=3),
                                  ldlq_quantize(w, None, a, b))


def test_hessian_aware_rounding_beats_plain_rounding():
    gains = []
    for seed in range(2):
        w, x = _correlated_layer(seed)
        h = hessian(x)
        cfg = UniSVQConfig(hadamard_block=32, tune_iters=3)
        plain = dequantize(quantize_linear(w, h, UniSVQConfig(hadamard_block=32,
                                                              use_hessian=False)))
        aware = dequantize(quantize_linear(w, h, cfg))
        out_err = [float(jnp.mean((x @ (q - w).T) ** 2)) for q in (plain, aware)]
        assert float(proxy_loss(w, aware, h)) < float(proxy_loss(w, plain, h))
        gains.append(out_err[0] / out_err[1])
    assert np.mean(gains) > 1.3, gains


def test_finetune_reduces_mse_codes_frozen_and_grads_match_fd():
    w, x = _correlated_layer(1)
    layer = QuantizedLinear(quantize_linear(w, hessian(x), UniSVQConfig(hadamard_block=32,
                                                                        tune_iters=1)))
    codes_before = np.asarray(layer.codes[...]).copy()
    graph, params, frozen = nnx.split(layer, nnx.Param, ...)

    def fn(p, f, xb):
        return nnx.merge(graph, p, f)(xb)

    xs, ys = x.reshape(16, 128, 32), (x @ w.T).reshape(16, 128, 16)
    # gradient wrt b (offset) vs central finite differences
    loss = lambda p: jnp.mean((fn(p, frozen, xs[:2]) - ys[:2]) ** 2)  # noqa: E731
    grad = jax.grad(loss)(params)
    eps = 1e-2
    for j in range(2):
        plus = jax.tree.map(lambda v: v, params)
        minus = jax.tree.map(lambda v: v, params)
        plus["offset"].set_value(params["offset"][...].at[j].add(eps))
        minus["offset"].set_value(params["offset"][...].at[j].add(-eps))
        fd = (loss(plus) - loss(minus)) / (2 * eps)
        np.testing.assert_allclose(grad["offset"][...][j], fd, rtol=5e-2, atol=1e-4)
    best, info = finetune_block(fn, params, xs, ys,
                                UniSVQConfig(finetune_steps=15, lr_scale=3e-3, lr_affine=3e-3),
                                frozen=frozen)
    assert info["val_mse_after"] < info["val_mse_before"]
    nnx.update(layer, best)
    np.testing.assert_array_equal(np.asarray(layer.codes[...]), codes_before)


def _tiny_llama():
    cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=32,
                      max_seq_len=32)
    return Llama(cfg, rngs=nnx.Rngs(0))


def test_quantize_model_save_load_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 64, (6, 16))
    probe = jnp.asarray(tokens[:2])
    model = _tiny_llama()
    report = quantize_model(model, tokens, method="unisvq", bits=2, layers=[1],
                            cfg=UniSVQConfig(tune_iters=0, finetune_steps=0), progress=False)
    assert isinstance(model.layers[1].mlp.down_proj, QuantizedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, nnx.Linear)
    assert report["bits_per_weight"] == pytest.approx(unisvq_bits_per_weight(32, 32))
    out = model(probe)[0]
    save_quantized(model, tmp_path / "q", report=report)
    loaded, tok = load_quantized(tmp_path / "q")
    assert tok is None
    np.testing.assert_allclose(loaded(probe)[0], out, atol=1e-5)

    rtn_model = _tiny_llama()
    quantize_model(rtn_model, None, method="rtn", bits=3, group_size=16, progress=False)
    assert isinstance(rtn_model.layers[0].self_attn.q_proj, RTNLinear)
    assert model_bits_per_weight(rtn_model) == pytest.approx(3 + (16 + 3) / 16)
    save_quantized(rtn_model, tmp_path / "r")
    loaded, _ = load_quantized(tmp_path / "r")
    np.testing.assert_allclose(loaded(probe)[0], rtn_model(probe)[0], atol=1e-5)


def test_quantize_model_bad_input():
    model = _tiny_llama()
    with pytest.raises(ValueError, match="calib_tokens is missing"):
        quantize_model(model, None, method="unisvq", bits=2, progress=False)
    with pytest.raises(ValueError, match=r"bits \(method=unisvq\)=5"):
        quantize_model(model, np.zeros((2, 8), int), method="unisvq", bits=5, progress=False)
    with pytest.raises(ValueError, match="group_size=24"):
        quantize_model(model, None, method="rtn", bits=2, group_size=24, progress=False)
    with pytest.raises(ValueError, match="method='gptq'"):
        quantize_model(model, None, method="gptq", progress=False)
    with pytest.raises(FileNotFoundError, match="quantization.json"):
        load_quantized("no-such-folder")


def test_all_digits_cover_lattice():
    a, b = initial_lattice()
    grid = np.asarray(make_grid(a, b))
    expected = np.array(list(itertools.product(range(4), repeat=4)), np.float32)
    np.testing.assert_allclose(grid, GRID_2BIT[expected.astype(int)], atol=1e-6)


def test_quantize_command_bad_input(tmp_path):
    import argparse

    from lowrank_jax.commands.quantize import register, run
    from lowrank_jax.quantize.pipeline import calibration_tokens

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["quantize", "--method", "unisvq", "--bits", "5", "--out",
                              str(tmp_path)])
    with pytest.raises(ValueError, match="--bits 5 is not supported by --method unisvq"):
        run(args)
    args = parser.parse_args(["quantize", "--calib-file", str(tmp_path / "none.txt"), "--out",
                              str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="--calib-file"):
        run(args)
    with pytest.raises(ValueError, match="calibration text is empty"):
        calibration_tokens(None, "  ", 4, 8)
    windows = calibration_tokens(None, "hello world " * 20, 4, 8)
    assert windows.shape == (4, 8)


def test_save_model_writes_a_quantized_folder_that_load_model_and_generate_read(tmp_path):
    from lowrank_jax.models.generate import generate
    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quant.layers import RTNLinear
    from lowrank_jax.quantize import quantize_model

    model = preset_model("tiny")
    quantize_model(model, None, method="rtn", bits=4, group_size=32, progress=False)
    folder = save_model(model, tmp_path / "q")  # quantized layers -> the quantized format
    assert (tmp_path / "q" / "quantization.json").is_file()
    loaded, _ = load_model(folder)
    assert isinstance(loaded.layers[1].mlp.down_proj, RTNLinear)
    tokens = jnp.asarray([[5, 9, 77, 3]], jnp.int32)
    np.testing.assert_allclose(loaded(tokens)[0], model(tokens)[0], atol=1e-5)
    assert (generate(loaded, None, [5, 9, 77], max_new_tokens=4).token_ids
            == generate(model, None, [5, 9, 77], max_new_tokens=4).token_ids)
