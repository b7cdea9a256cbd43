"""QLoRA: LoRA on RTN-4 / NF4 / UniSVQ-2 bases; merging into fp (exact) and into a re-quantized
base (error reported)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.nn import apply_lora, dense_matrix, lora_layers
from lowrank_jax.nn.merge import merge_adapters, merge_report
from lowrank_jax.nn.qlora import QLoRALinear
from lowrank_jax.quantize.qlora_base import quantize_base

CFG = LlamaConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128,
                  max_seq_len=32)
TOKENS = jax.random.randint(jax.random.PRNGKey(5), (2, 12), 0, 64)


def qlora_model(method, seed=0):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, method)
    paths = apply_lora(model, {r"(q|v|down)_proj": 4}, rngs=nnx.Rngs(seed))
    for i, (_, layer) in enumerate(lora_layers(model)):  # a trained-looking, nonzero adapter
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(10 + i),
                                                    layer.lora_b[...].shape)
    return model, paths


@nnx.jit
def logits(model):
    return model(TOKENS)[0]


@pytest.mark.parametrize("method", ["rtn4", "nf4", "unisvq2"])
def test_apply_lora_wraps_quantized_projections(method):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, method)
    before = logits(model)
    paths = apply_lora(model, {r"(q|v|down)_proj": 4}, rngs=nnx.Rngs(1))
    assert sorted(paths) == ["layers/0/mlp/down_proj", "layers/0/self_attn/q_proj",
                             "layers/0/self_attn/v_proj"]
    assert all(isinstance(m, QLoRALinear) for _, m in lora_layers(model))
    np.testing.assert_allclose(logits(model), before, atol=1e-6)  # B = 0: unchanged at init


@pytest.mark.parametrize("method", ["rtn4", "nf4", "unisvq2"])
def test_training_moves_only_the_adapter(method):
    model, _ = qlora_model(method)
    frozen = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(model, opt):
        def loss(m):
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
                m(TOKENS[:, :-1])[0], TOKENS[:, 1:]))
        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return value

    losses = [float(step(model, opt)) for _ in range(5)]
    assert losses[-1] < losses[0]
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, frozen, after)  # codes, scales untouched


@pytest.mark.parametrize("method", ["rtn4", "nf4", "unisvq2"])
def test_merge_to_fp_is_exact(method):
    model, paths = qlora_model(method)
    expect = logits(model)
    layer = dict(lora_layers(model))["layers/0/self_attn/q_proj"]
    w_expect = np.asarray(layer.dense_matrix() + layer.delta())
    errors = merge_adapters(model, target="fp")
    assert errors == {p: 0.0 for p in paths}
    assert not lora_layers(model)
    merged = model.layers[0].self_attn.q_proj
    assert type(merged) is nnx.Linear
    np.testing.assert_allclose(np.asarray(merged.kernel[...]), w_expect, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(logits(model), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["rtn4", "nf4", "unisvq2"])
def test_merge_to_quantized_reports_its_error(method):
    model, paths = qlora_model(method)
    layer = dict(lora_layers(model))["layers/0/self_attn/q_proj"]
    w = (layer.dense_matrix() + layer.delta()).T
    kind = type(layer.base)

    @nnx.jit
    def nll(m):
        lg = m(TOKENS[:, :-1])[0]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(lg, TOKENS[:, 1:]))

    def ppl(m):
        return float(jnp.exp(nll(m)))

    merged, report = merge_report(model, ppl, target="quantized")
    assert lora_layers(model)  # the input model keeps its adapters
    q = merged.layers[0].self_attn.q_proj
    assert type(q) is kind  # re-quantized with the base's own method
    w_hat = dense_matrix(q).T
    rel = float(jnp.linalg.norm(w_hat - w) / jnp.linalg.norm(w))
    assert rel > 1e-3  # re-quantization is not free...
    assert report["layer_error_max"] >= rel - 1e-6
    assert report["ppl_adapter"] == pytest.approx(ppl(model))
    assert report["ppl_merged"] == pytest.approx(ppl(merged))
    assert report["ppl_added"] == pytest.approx(report["ppl_merged"] - report["ppl_adapter"])
    assert report["ppl_added"] != 0.0
    assert report["layers"] == 3


def test_pissa_on_a_quantized_base_is_refused():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, "nf4")
    with pytest.raises(ValueError, match="init='pissa'"):
        apply_lora(model, [dict(pattern="q_proj", init="pissa")],
                   rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="method='int3'"):
        quantize_base(model, "int3")


def test_a_quantized_folder_takes_adapters(tmp_path):
    from lowrank_jax.hub import load_model, save_model

    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, "rtn4")
    save_model(model, tmp_path / "q")
    loaded, _ = load_model(str(tmp_path / "q"))  # what `finetune --model <folder>` reads
    assert apply_lora(loaded, {"q_proj": 4}, rngs=nnx.Rngs(1)) == ["layers/0/self_attn/q_proj"]
    layer = loaded.layers[0].self_attn.q_proj
    assert isinstance(layer, QLoRALinear) and type(layer.base).__name__ == "RTNLinear"
    np.testing.assert_allclose(logits(loaded), logits(model), atol=1e-5)
