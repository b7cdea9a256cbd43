"""UniSVQ-3: the {0..7}⁴ lattice (4096 codewords, 12-bit codes) end to end on tiny shapes."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.quant.lattice import (
    GAUSSIAN_STEP_3BIT,
    all_digits,
    initial_lattice,
    make_grid,
    nearest_codeword,
    random_orthogonal,
    round_to_lattice,
)
from lowrank_jax.quant.packing import (
    pack_bits,
    storage_bits,
    unisvq_bits_per_weight,
    unpack_bits,
)
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    dequantize,
    hessian,
    ldlq_quantize,
    proxy_loss,
    quantize_linear,
    rotate_problem,
)
from pallas_kernels.lattice_matmul.api import code_matmul, lattice_matmul
from pallas_kernels.lattice_matmul.reference import code_bits, decode_codes, unpack_planes


def test_grid_has_4096_unit_variance_codewords_in_index_order():
    a, b = initial_lattice(None, bits=3)  # O = I: the uniform 3-bit grid on every coordinate
    grid = np.asarray(make_grid(a, b, bits=3))
    assert grid.shape == (4096, 4)
    levels = (np.arange(8) - 3.5) * GAUSSIAN_STEP_3BIT  # Max's optimal step for N(0, 1)
    expected = np.array(list(itertools.product(range(8), repeat=4)))  # idx = 512 z0 + ... + z3
    np.testing.assert_allclose(grid, levels[expected], atol=1e-6)
    np.testing.assert_allclose(grid.mean(0), 0.0, atol=1e-6)
    # the grid is the MSE-optimal 8-level uniform quantizer of a unit Gaussian: 0.0374 (Max)
    g = np.random.default_rng(0).normal(size=200_000)
    err = g - levels[np.clip(np.round(g / GAUSSIAN_STEP_3BIT + 3.5), 0, 7).astype(int)]
    assert np.mean(err**2) == pytest.approx(0.0374, abs=1e-3)
    assert len({tuple(r) for r in np.round(grid, 5)}) == 4096
    np.testing.assert_array_equal(all_digits(3), expected)


def test_rounding_equals_exhaustive_argmin_for_a_rotated_lattice():
    a, b = initial_lattice(random_orthogonal(jax.random.PRNGKey(3)), bits=3)
    grid = make_grid(a, b, bits=3)
    # inside the lattice, on its edges and far outside (the clip must still be the argmin)
    w = jax.random.normal(jax.random.PRNGKey(4), (3000, 4)) * jnp.array([0.5, 1.0, 2.0, 4.0])
    fast = np.asarray(round_to_lattice(w, a, b, bits=3))
    exhaustive = np.asarray(nearest_codeword(w, grid))
    dist = lambda idx: np.sum((np.asarray(w) - np.asarray(grid)[idx]) ** 2, axis=-1)  # noqa: E731
    np.testing.assert_allclose(dist(fast), dist(exhaustive), rtol=1e-5, atol=1e-6)
    assert np.mean(fast == exhaustive) > 0.999  # different only on (float) ties
    # the same shortcut is exact for the 2-bit lattice
    a2, b2 = initial_lattice(random_orthogonal(jax.random.PRNGKey(3)))
    np.testing.assert_array_equal(round_to_lattice(w, a2, b2),
                                  nearest_codeword(w, make_grid(a2, b2)))


def test_3bit_ldlq_is_exact_on_the_grid_and_much_better_than_2bit():
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (32, 64))
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 64)) * jnp.linspace(0.2, 2.0, 64)
    h = hessian(x)
    losses = {}
    for bits in (2, 3):
        q = quantize_linear(w, h, UniSVQConfig(bits=bits, hadamard_block=16, tune_iters=2))
        assert q.codes.dtype == (jnp.uint8 if bits == 2 else jnp.uint16)
        assert code_bits(q.codes) == bits == q.bits
        losses[bits] = float(proxy_loss(w, dequantize(q), h))
    # one more bit per digit halves the step: the error energy drops by about 4x
    assert losses[3] < 0.4 * losses[2], losses
    # LDLQ's codes are exactly what the exhaustive search of the same rounding order gives
    w_rot, _, _, _, h_rot = rotate_problem(w, h, key, 16, 16)
    a, b = initial_lattice(random_orthogonal(jax.random.split(key, 3)[2]), bits=3)
    codes = ldlq_quantize(w_rot, None, a, b, bits=3)  # no Hessian: plain nearest codeword
    np.testing.assert_array_equal(
        codes, round_to_lattice(w_rot.reshape(32, 16, 4), a, b, bits=3).astype(jnp.uint16))
    assert proxy_loss(w_rot, decode_codes(codes, a, b), h_rot) > 0  # finite, a real loss


def test_12bit_codes_pack_to_exactly_3_bits_per_weight():
    codes = np.random.default_rng(0).integers(0, 4096, size=(6, 5)).astype(np.uint16)
    stream = pack_bits(codes, 12)
    assert stream.dtype == np.uint8 and stream.size == 45  # 30 codes × 12 bits = 360 bits
    np.testing.assert_array_equal(unpack_bits(stream, 12, 30).reshape(6, 5), codes)
    with pytest.raises(ValueError, match="does not fit in bits=12"):
        pack_bits(np.array([4096]), 12)
    assert unisvq_bits_per_weight(24, 20, bits=3) == (24 * 5 * 12 + 16 * (24 + 20 + 20)) / 480
    with pytest.raises(ValueError, match="bits=5"):
        unisvq_bits_per_weight(8, 8, bits=5)
    with pytest.raises(ValueError, match="bits=5"):
        UniSVQConfig(bits=5)


@pytest.mark.parametrize("mode", ["fold", "dequant"])
def test_kernel_equals_the_dequantized_dense_weight(mode):
    w = jax.random.normal(jax.random.PRNGKey(5), (24, 32))
    q = quantize_linear(w, None, UniSVQConfig(bits=3, hadamard_block=8))
    assert [int(p.max()) for p in unpack_planes(q.codes)] == [7, 7, 7, 7]  # 3-bit digits used
    x = jax.random.normal(jax.random.PRNGKey(6), (5, 32))
    dense = np.asarray(x @ dequantize(q).T)
    args = (q.codes, q.scale_in, q.scale_out, q.affine, q.offset)
    for impl in ("xla", "pallas"):
        got = lattice_matmul(x, *args, block_in=q.block_in, block_out=q.block_out, mode=mode,
                             implementation=impl, interpret=True)
        np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-4 * np.abs(dense).max())
    x_rot = jax.random.normal(jax.random.PRNGKey(7), (3, 32))
    np.testing.assert_allclose(
        code_matmul(x_rot, q.codes, q.affine, q.offset, mode=mode, implementation="pallas",
                    interpret=True),
        x_rot @ decode_codes(q.codes, q.affine, q.offset).T, rtol=1e-4, atol=1e-4)


def test_3bit_model_folder_accounting_equals_stored_arrays(tmp_path):
    from safetensors.numpy import load_file

    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quant.layers import QuantizedLinear
    from lowrank_jax.quantize.pipeline import model_bits_per_weight, quantize_model

    model = preset_model("tiny")
    calib = np.random.default_rng(0).integers(0, 256, size=(4, 32))
    report = quantize_model(model, calib, method="unisvq", bits=3, progress=False,
                            cfg=UniSVQConfig(tune_iters=1, finetune_steps=2))
    lin = model.layers[0].mlp.down_proj
    assert isinstance(lin, QuantizedLinear) and lin.bits == 3
    assert lin.codes[...].dtype == jnp.uint16
    save_model(model, tmp_path / "q")
    arrays = load_file(str(tmp_path / "q" / "model.safetensors"))
    meta = json.loads((tmp_path / "q" / "quantization.json").read_text())["layers"]
    stored = total = 0
    for prefix, info in meta.items():
        assert info["method"] == "unisvq" and info["bits"] == 3
        mine = {k: v for k, v in arrays.items() if k.startswith(prefix + ".")}
        assert sorted(k.rsplit(".", 1)[1] for k in mine) == [
            "affine", "codes12", "offset", "scale_in", "scale_out"]
        m, n = info["shape"]
        assert storage_bits(mine) == unisvq_bits_per_weight(m, n, bits=3) * m * n
        stored += storage_bits(mine)
        total += m * n
    assert report["bits_per_weight"] == pytest.approx(stored / total)
    assert model_bits_per_weight(model) == pytest.approx(stored / total)
    back, _ = load_model(str(tmp_path / "q"))
    tokens = jnp.asarray([[5, 9, 77, 3]], jnp.int32)
    np.testing.assert_allclose(back(tokens)[0], model(tokens)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(back.layers[0].mlp.down_proj.codes[...], lin.codes[...])


@pytest.mark.slow
def test_quantize_command_writes_a_3bit_folder(tmp_path, capsys):
    from lowrank_jax.cli import main

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    folder = str(tmp_path / "q3")
    assert main(["quantize", "--model", "tiny", "--method", "unisvq", "--bits", "3",
                 "--calib-file", str(text), "--calib-seqs", "4", "--seq-len", "32",
                 "--tune-iters", "1", "--finetune-steps", "2", "--out", folder]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["bits"] == 3 and 3.0 < summary["bits_per_weight"] < 4.0
    assert main(["quantize", "--model", "tiny", "--method", "kmeans", "--bits", "3",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "--bits 3 is not supported by --method kmeans" in capsys.readouterr().err
