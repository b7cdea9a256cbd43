"""UniSVQ-4: the {0..15}⁴ lattice (65536 codewords, 16-bit codes) and the explicit ``bits``
metadata that tells 3- from 4-bit ``uint16`` codes, on tiny shapes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.quant.lattice import (
    GAUSSIAN_STEP_4BIT,
    all_digits,
    initial_lattice,
    make_grid,
    nearest_codeword,
    random_orthogonal,
    round_to_lattice,
)
from lowrank_jax.quant.packing import pack_bits, storage_bits, unisvq_bits_per_weight, unpack_bits
from lowrank_jax.quant.unisvq import (
    UniSVQConfig,
    UniSVQWeight,
    dequantize,
    hessian,
    proxy_loss,
    quantize_linear,
)
from pallas_kernels.lattice_matmul.api import code_matmul, lattice_matmul
from pallas_kernels.lattice_matmul.reference import code_bits, decode_codes, unpack_planes


def test_4bit_identity_lattice_is_per_coordinate_16_level_rounding():
    a, b = initial_lattice(None, bits=4)  # O = I: scalar quantization is the special case
    levels = (np.arange(16) - 7.5) * GAUSSIAN_STEP_4BIT
    digits = np.asarray(all_digits(4))
    assert digits.shape == (65536, 4) and digits.max() == 15
    np.testing.assert_array_equal(digits[0x7A3F], [7, 10, 3, 15])  # idx = 4096 z0 + ... + z3
    grid = np.asarray(make_grid(a, b, bits=4))
    np.testing.assert_allclose(grid, levels[digits], atol=1e-6)
    w = np.random.default_rng(0).normal(size=(4000, 4)).astype(np.float32)
    z = np.asarray(all_digits(4))[np.asarray(round_to_lattice(jnp.asarray(w), a, b, bits=4))]
    rtn = np.clip(np.round(w / GAUSSIAN_STEP_4BIT + 7.5), 0, 15)
    np.testing.assert_array_equal(z, rtn)
    # Max (1960): the optimal 16-level uniform quantizer of N(0, 1) has MSE 0.01154
    g = np.random.default_rng(1).normal(size=200_000)
    err = g - levels[np.clip(np.round(g / GAUSSIAN_STEP_4BIT + 7.5), 0, 15).astype(int)]
    assert np.mean(err**2) == pytest.approx(0.01154, abs=5e-4)


def test_4bit_rounding_equals_exhaustive_argmin_for_a_rotated_lattice():
    a, b = initial_lattice(random_orthogonal(jax.random.PRNGKey(3)), bits=4)
    grid = make_grid(a, b, bits=4)
    w = jax.random.normal(jax.random.PRNGKey(4), (256, 4)) * jnp.array([0.5, 1.0, 2.0, 4.0])
    fast = np.asarray(round_to_lattice(w, a, b, bits=4))
    exhaustive = np.asarray(nearest_codeword(w, grid))
    dist = lambda idx: np.sum((np.asarray(w) - np.asarray(grid)[idx]) ** 2, axis=-1)  # noqa: E731
    np.testing.assert_allclose(dist(fast), dist(exhaustive), rtol=1e-5, atol=1e-6)
    assert np.mean(fast == exhaustive) > 0.99  # different only on (float) ties


def test_4bit_quantizer_beats_3bit_and_keeps_its_bits_as_metadata():
    w = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 64)) * jnp.linspace(0.2, 2.0, 64)
    h = hessian(x)
    losses = {}
    for bits in (3, 4):
        q = quantize_linear(w, h, UniSVQConfig(bits=bits, hadamard_block=16, tune_iters=2))
        assert q.codes.dtype == jnp.uint16 and q.bits == bits
        losses[bits] = float(proxy_loss(w, dequantize(q), h))
    assert losses[4] < 0.4 * losses[3], losses  # half the step: about 4x less error energy
    # the pytree keeps ``bits`` as static metadata (uint16 alone would say 3)
    leaves, tree = jax.tree.flatten(q)
    assert jax.tree.unflatten(tree, leaves).bits == 4
    assert jax.jit(lambda v: v)(q).bits == 4
    assert UniSVQWeight(q.codes, q.scale_in, q.scale_out, q.affine, q.offset).bits == 3
    with pytest.raises(ValueError, match="cannot hold 4 digits of bits=4"):
        UniSVQWeight(q.codes.astype(jnp.uint8), q.scale_in, q.scale_out, q.affine, q.offset,
                     bits=4)
    with pytest.raises(ValueError, match="bits=5"):
        UniSVQConfig(bits=5)


@pytest.mark.parametrize("mode", ["fold", "dequant"])
def test_4bit_kernel_equals_the_dequantized_dense_weight(mode):
    w = jax.random.normal(jax.random.PRNGKey(5), (24, 32))
    q = quantize_linear(w, None, UniSVQConfig(bits=4, hadamard_block=8))
    planes = unpack_planes(q.codes, 4)
    assert min(int(p.max()) for p in planes) > 7  # digits beyond the 3-bit range are used
    x = jax.random.normal(jax.random.PRNGKey(6), (5, 32))
    dense = np.asarray(x @ dequantize(q).T)
    args = (q.codes, q.scale_in, q.scale_out, q.affine, q.offset)
    for impl in ("xla", "pallas"):
        got = lattice_matmul(x, *args, block_in=q.block_in, block_out=q.block_out, mode=mode,
                             implementation=impl, interpret=True, bits=4)
        np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-4 * np.abs(dense).max())
    x_rot = jax.random.normal(jax.random.PRNGKey(7), (3, 32))
    want = x_rot @ decode_codes(q.codes, q.affine, q.offset, 4).T
    np.testing.assert_allclose(
        code_matmul(x_rot, q.codes, q.affine, q.offset, mode=mode, implementation="pallas",
                    interpret=True, bits=4), want, rtol=1e-4, atol=1e-4)
    # without the metadata the same uint16 codes read as 3-bit digits: a different matrix
    assert not np.allclose(decode_codes(q.codes, q.affine, q.offset),
                           decode_codes(q.codes, q.affine, q.offset, 4))


def test_16bit_codes_pack_to_exactly_4_bits_per_weight():
    codes = np.random.default_rng(0).integers(0, 65536, size=(6, 5)).astype(np.uint16)
    stream = pack_bits(codes, 16)
    assert stream.dtype == np.uint8 and stream.size == 60  # 30 codes × 16 bits
    np.testing.assert_array_equal(unpack_bits(stream, 16, 30).reshape(6, 5), codes)
    assert unisvq_bits_per_weight(24, 20, bits=4) == (24 * 5 * 16 + 16 * (24 + 20 + 20)) / 480
    assert code_bits(jnp.zeros((1, 1), jnp.uint16), 4) == 4


def test_4bit_model_folder_round_trip_and_accounting(tmp_path):
    from safetensors.numpy import load_file

    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quant.layers import QuantizedLinear
    from lowrank_jax.quantize.pipeline import model_bits_per_weight, quantize_model

    model = preset_model("tiny")  # block 0 quantized (fast), the others stay dense
    calib = np.random.default_rng(0).integers(0, 256, size=(4, 32))
    report = quantize_model(model, calib, method="unisvq", bits=4, progress=False, layers=[0],
                            cfg=UniSVQConfig(tune_iters=1, finetune_steps=0))
    lin = model.layers[0].mlp.down_proj
    assert isinstance(lin, QuantizedLinear) and lin.bits == 4
    save_model(model, tmp_path / "q")
    arrays = load_file(str(tmp_path / "q" / "model.safetensors"))
    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    stored = total = 0
    for prefix, info in manifest["layers"].items():
        if not prefix.startswith("layers.0."):
            assert info["method"] == "dense"
            continue
        assert info["method"] == "unisvq" and info["bits"] == 4
        mine = {k: v for k, v in arrays.items() if k.startswith(prefix + ".")}
        assert sorted(k.rsplit(".", 1)[1] for k in mine) == [
            "affine", "codes16", "offset", "scale_in", "scale_out"]
        m, n = info["shape"]
        assert storage_bits(mine) == unisvq_bits_per_weight(m, n, bits=4) * m * n
        stored += storage_bits(mine)
        total += m * n
    assert report["bits_per_weight"] == pytest.approx(stored / total)
    back, _ = load_model(str(tmp_path / "q"))
    assert back.layers[0].mlp.down_proj.bits == 4
    assert model_bits_per_weight(back) == pytest.approx(model_bits_per_weight(model))
    tokens = jnp.asarray([[5, 9, 77, 3]], jnp.int32)
    np.testing.assert_allclose(back(tokens)[0], model(tokens)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(back.layers[0].mlp.down_proj.codes[...], lin.codes[...])


def test_folder_without_bits_metadata_still_loads_as_2bit(tmp_path):
    """Folders written before the ``bits`` field (2-bit ``uint8`` codes, no ``"bits"``)."""
    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quantize.pipeline import quantize_model

    model = preset_model("tiny")
    calib = np.random.default_rng(0).integers(0, 256, size=(4, 32))
    quantize_model(model, calib, method="unisvq", bits=2, progress=False, layers=[0],
                   cfg=UniSVQConfig(tune_iters=0, finetune_steps=0))
    save_model(model, tmp_path / "old")
    path = tmp_path / "old" / "quantization.json"
    manifest = json.loads(path.read_text())
    for info in manifest["layers"].values():
        info.pop("bits", None)
    path.write_text(json.dumps(manifest))
    back, _ = load_model(str(tmp_path / "old"))
    assert back.layers[0].self_attn.q_proj.bits == 2
    tokens = jnp.asarray([[5, 9, 77, 3]], jnp.int32)
    np.testing.assert_allclose(back(tokens)[0], model(tokens)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_quantize_command_writes_a_4bit_folder(tmp_path, capsys):
    from lowrank_jax.cli import main
    from lowrank_jax.commands.quantize import _METHOD_BITS as COMMAND_BITS
    from lowrank_jax.quantize.pipeline import METHOD_BITS

    assert all(COMMAND_BITS[k] == METHOD_BITS[k] for k in COMMAND_BITS)  # one table of bits

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    folder = str(tmp_path / "q4")
    assert main(["quantize", "--model", "tiny", "--method", "unisvq", "--bits", "4",
                 "--calib-file", str(text), "--calib-seqs", "4", "--seq-len", "32",
                 "--tune-iters", "1", "--finetune-steps", "2", "--out", folder]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["bits"] == 4 and 4.0 < summary["bits_per_weight"] < 5.0
    assert main(["quantize", "--model", "tiny", "--method", "unisvq", "--bits", "5",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "--bits 5 is not supported by --method unisvq" in capsys.readouterr().err


def test_2bit_quantizer_codes_equal_the_exhaustive_ldlq_search():
    """The quantizer rounds every lattice by coordinates (``round_to_lattice``); for 2 bits that is
    the same LDLQ result as the exhaustive search over the 256 codewords (``ldlq_quantize``)."""
    from lowrank_jax.quant.unisvq import ldlq_quantize, rotate_problem

    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (32, 64))
    x = jax.random.normal(jax.random.PRNGKey(1), (512, 64)) * jnp.linspace(0.2, 2.0, 64)
    h = hessian(x)
    q = quantize_linear(w, h, UniSVQConfig(hadamard_block=16, tune_iters=2), key=key)
    assert q.codes.dtype == jnp.uint8 and q.bits == 2
    w_rot, _, _, _, h_rot = rotate_problem(w, h, key, 16, 16)
    a, b = initial_lattice(random_orthogonal(jax.random.split(key, 3)[2]))
    np.testing.assert_allclose(q.affine, a)
    exhaustive = ldlq_quantize(w_rot, h_rot, a, b, tune_iters=2)
    assert np.mean(np.asarray(q.codes) == np.asarray(exhaustive)) > 0.999
