"""The library on NNX LLMs it did not write: tunix's Llama 3, Qwen 3 and Gemma (tiny random
configs), three projection layouts.

- Llama 3 / Qwen 3: ``q/k/v_proj`` einsums ``'BTD,DNH->BTNH'`` (kernel ``[D, N, H]``),
  ``o_proj`` ``'BTNH,NHD->BTD'``, an ``nnx.Linear`` MLP, an einsum ``lm_head``; Qwen 3 adds
  per-head q/k norms, and its MoE variant keeps the experts as bare ``nnx.Param [E, D, F]``.
- Gemma: ``q_einsum`` ``'BTD,NDH->BTNH'`` (``[N, D, H]``) plus the fused ``kv_einsum``
  ``'BSD,CKDH->CBSKH'``, or one fused ``qkv_einsum`` ``'BTD,SNDH->SBTNH'`` when every query head
  has its own k/v; ``attn_vec_einsum``; tied embeddings.

The models' own forward reads public attributes of its projection modules (``o_proj.shape[1]``
is the head dim), so these tests also hold every swapped-in module to the interface of the one
it replaces. The models come from the ``google-tunix`` package (``pip install --no-deps
google-tunix``); only its model files are imported (its package ``__init__`` pulls in training
dependencies).
"""

import copy
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.io import export_peft, import_peft
from lowrank_jax.nn import LoRARule, apply_lora, factorize, lora_layers, projection_paths
from lowrank_jax.optim import balora, find_pairs, spectron_with_adamw

try:  # the adapter core moves it to lowrank_jax.quant (nn never imports quant)
    from lowrank_jax.quant import quantize_projections
except ImportError:
    from lowrank_jax.nn import quantize_projections

INSTALL = "pip install --no-deps google-tunix"
V, D, N, K, H, F = 64, 32, 4, 2, 8, 64
EVERY = "."  # a rule that matches every projection


def tunix_module(family: str):
    """``tunix.models.<family>.model`` without running ``tunix/__init__.py`` (which imports
    tunix's trainers and their dependencies): the packages on the way are empty stand-ins."""
    if "tunix" in sys.modules:
        root = list(sys.modules["tunix"].__path__)[0]
    else:
        spec = importlib.util.find_spec("tunix")
        if spec is None:
            pytest.fail(f"these tests run tunix's NNX models; install them with `{INSTALL}`.")
        root = os.path.dirname(spec.origin)
    for sub in ("", "models", "generate", "utils", f"models/{family}"):
        name = "tunix" + ("." + sub.replace("/", ".") if sub else "")
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, sub)]
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            package.__spec__.submodule_search_locations = package.__path__
            sys.modules[name] = package
    return importlib.import_module(f"tunix.models.{family}.model")


def build(kind: str, seed: int = 0):
    """A tiny tunix model of ``kind`` with every weight random (a loaded checkpoint; tunix
    zero-initialises some of them), and its name map."""
    if kind in ("llama3", "qwen3", "qwen3_moe"):
        family = "llama3" if kind == "llama3" else "qwen3"
        lib = tunix_module(family)
        extra = {"num_experts": 4, "num_experts_per_tok": 2} if kind == "qwen3_moe" else {}
        config = lib.ModelConfig(num_layers=1, vocab_size=V, embed_dim=D, hidden_dim=F,
                                 num_heads=N, head_dim=H, num_kv_heads=K, rope_theta=10_000,
                                 norm_eps=1e-5, **extra)
        model = (lib.Llama3 if family == "llama3" else lib.Qwen3)(config, rngs=nnx.Rngs(0))
        name_map = "llama" if family == "llama3" else "qwen"
    else:
        lib = tunix_module("gemma")
        config = lib.ModelConfig(
            num_layers=1, num_embed=V, embed_dim=D, hidden_dim=F, num_heads=N, head_dim=H,
            num_kv_heads=N if kind == "gemma_qkv" else 1, final_logit_softcap=None,
            use_post_attn_norm=False, use_post_ffw_norm=False,
            attention_types=(lib.AttentionType.GLOBAL,))
        model, name_map = lib.Gemma(config, rngs=nnx.Rngs(0)), "gemma"
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(
        rng.normal(1.0 if x.ndim == 1 else 0.0, 0.1 if x.ndim == 1 else 0.5 / np.sqrt(x.shape[-2]),
                   x.shape), x.dtype), state)
    return nnx.merge(graphdef, state), name_map


FAMILIES = ["llama3", "qwen3", "gemma_kv", "gemma_qkv"]
# the fused-qkv Gemma layout runs the factorize / NF4 / BaLoRA checks in the slow tier only
THREE_FAMILIES = FAMILIES[:3] + [pytest.param("gemma_qkv", marks=pytest.mark.slow)]
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 9)), jnp.int32)
T = TOKENS.shape[1] - 1
POSITIONS = jnp.broadcast_to(jnp.arange(T), (2, T))
MASK = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (2, T, T))


def forward(model):
    """The model's own forward (tunix's signature: tokens, positions, cache, mask)."""
    logits, _ = model(TOKENS[:, :-1], POSITIONS, None, MASK)
    return logits


def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(forward(model), TOKENS[:, 1:]).mean()


def train(model, tx, wrt, steps):
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)]


def attention_paths(model):
    return [p for p in projection_paths(model) if "/attn/" in p]


def test_the_protocol_sees_every_projection_of_each_layout():
    seen = {kind: [p.split("/", 2)[-1] for p in projection_paths(build(kind)[0])
                   if p.startswith("layers/0/")] for kind in FAMILIES}
    mlp = ["mlp/down_proj", "mlp/gate_proj", "mlp/up_proj"]
    assert seen["llama3"] == seen["qwen3"] == [f"attn/{n}_proj" for n in "koqv"] + mlp
    assert seen["gemma_kv"] == ["attn/attn_vec_einsum", "attn/kv_einsum", "attn/q_einsum"] + mlp
    assert seen["gemma_qkv"] == ["attn/attn_vec_einsum", "attn/qkv_einsum"] + mlp


@pytest.mark.parametrize("kind", FAMILIES)
def test_lora_on_every_projection_keeps_the_output_and_trains(kind):
    model, _ = build(kind)
    before = np.asarray(forward(model))
    paths = projection_paths(model)
    assert apply_lora(model, LoRARule(EVERY, rank=4), rngs=nnx.Rngs(1)) == paths
    np.testing.assert_allclose(np.asarray(forward(model)), before, atol=1e-6)  # B = 0
    assert len(find_pairs(nnx.state(model, nnx.LoRAParam), kinds=("lora",))) == len(paths)
    losses = train(model, optax.adam(1e-2), nnx.LoRAParam, 3)
    assert losses[-1] < losses[0], losses
    for path, layer in lora_layers(model):
        assert float(jnp.abs(layer.lora_b[...]).max()) > 0, path  # every adapter trained


@pytest.mark.parametrize("kind", THREE_FAMILIES)
def test_factorize_is_exact_at_full_rank_and_trains_with_spectron(kind):
    model, _ = build(kind)
    before, paths = np.asarray(forward(model)), projection_paths(model)
    exact = factorize(copy.deepcopy(model), EVERY, rank_ratio=1.0)
    assert max(r["error"] for r in exact.values()) < 1e-5
    report = factorize(model, EVERY, rank_ratio=0.5)
    assert list(report) == paths
    assert len(find_pairs(nnx.state(model, nnx.Param), kinds=("factor",))) == len(report)
    assert np.isfinite(np.asarray(forward(model))).all()
    assert not np.allclose(np.asarray(forward(model)), before)  # rank 1/2 is an approximation
    losses = train(model, spectron_with_adamw(0.05, 1e-3, ns_coeffs="exact"), nnx.Param, 3)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("kind", THREE_FAMILIES)
def test_nf4_base_plus_lora_keeps_the_quantized_output_and_trains(kind):
    model, _ = build(kind)
    dense, paths = np.asarray(forward(model)), projection_paths(model)
    errors = quantize_projections(model, EVERY, "nf4", group_size=32)
    assert list(errors) == paths
    assert all(0 < e < 0.15 for e in errors.values())
    quantized = np.asarray(forward(model))
    assert 0 < np.abs(quantized - dense).max() < 1.0
    apply_lora(model, LoRARule(EVERY, rank=4), rngs=nnx.Rngs(2))
    np.testing.assert_allclose(np.asarray(forward(model)), quantized, atol=1e-6)
    losses = train(model, optax.adam(1e-2), nnx.LoRAParam, 3)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("kind", THREE_FAMILIES)
def test_balora_trains_every_adapter_balanced(kind):
    from lowrank_jax.optim.balora import balancing_gap

    model, _ = build(kind)
    apply_lora(model, LoRARule(EVERY, rank=4, init="gaussian"), rngs=nnx.Rngs(1))
    losses = train(model, balora(optax.adam(1e-2)), nnx.LoRAParam, 3)
    assert losses[-1] < losses[0], losses
    for path, layer in lora_layers(model):
        assert float(balancing_gap(layer.lora_a[...], layer.lora_b[...])) < 1e-3, path


@pytest.mark.parametrize("kind", FAMILIES)
def test_peft_round_trip_with_hf_names_and_widths(kind, tmp_path):
    from safetensors.numpy import load_file

    model, name_map = build(kind)
    apply_lora(model, LoRARule(EVERY, rank=4), rngs=nnx.Rngs(3))
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(i), layer.lora_b[...].shape)
    config = export_peft(model, tmp_path, name_map=name_map)
    names = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_modules"] == sorted(names + (["lm_head"] if "qwen" in kind or
                                                       "llama" in kind else []))
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    kv_heads = {"gemma_kv": 1, "gemma_qkv": N}.get(kind, K)
    pre = "base_model.model.model.layers.0."
    widths = {"q_proj": N * H, "k_proj": kv_heads * H, "v_proj": kv_heads * H, "o_proj": D}
    for name, width in widths.items():  # HF's [out, in] widths, fused kernels split
        assert tensors[pre + f"self_attn.{name}.lora_B.weight"].shape == (width, 4), name
    assert tensors[pre + "self_attn.o_proj.lora_A.weight"].shape == (4, N * H)
    assert tensors[pre + "mlp.down_proj.lora_A.weight"].shape == (4, F)
    expected = np.asarray(forward(model))
    fresh, _ = build(kind)
    assert sorted(import_peft(fresh, tmp_path, name_map=name_map)) == sorted(
        p for p, _ in lora_layers(model))
    np.testing.assert_allclose(np.asarray(forward(fresh)), expected, atol=1e-5)


def test_moe_expert_kernels_are_refused_by_name_never_skipped(tmp_path):
    """The decision for expert kernels (bare ``nnx.Param [E, D, F]`` the MoE layer indexes
    itself): no LoRA per expert; a rule that matches one is an error naming it and the way
    out, also when the rule matches projections too; the same for an adapter that holds them."""
    from safetensors.numpy import save_file

    model, name_map = build("qwen3_moe")
    for rule in (EVERY, r"mlp/(gate|up|down)_proj"):
        with pytest.raises(ValueError, match=r"matches expert kernels: layers/0/mlp/down_proj "
                                             r"\[4, 64, 32\].*narrow the rule"):
            apply_lora(model, LoRARule(rule, rank=4), rngs=nnx.Rngs(1))
    assert not lora_layers(model)  # nothing was half-adapted
    before = np.asarray(forward(model))
    assert apply_lora(model, LoRARule("attn/|router", rank=4), rngs=nnx.Rngs(1)) == [
        "layers/0/attn/k_proj", "layers/0/attn/o_proj", "layers/0/attn/q_proj",
        "layers/0/attn/v_proj", "layers/0/mlp/router"]
    np.testing.assert_allclose(np.asarray(forward(model)), before, atol=1e-6)
    losses = train(model, optax.adam(1e-2), nnx.LoRAParam, 3)
    assert losses[-1] < losses[0], losses
    # export: the router is HF Qwen3-MoE's mlp.gate; the experts are not claimed
    config = export_peft(model, tmp_path / "adapter", name_map=name_map)
    assert config["target_modules"] == ["gate", "k_proj", "o_proj", "q_proj", "v_proj"]
    fresh, _ = build("qwen3_moe")
    import_peft(fresh, tmp_path / "adapter", name_map=name_map)
    np.testing.assert_allclose(np.asarray(forward(fresh)), np.asarray(forward(model)), atol=1e-5)
    # import: an adapter trained on HF's per-expert Linear modules is refused by name
    folder = tmp_path / "experts"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
    key = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    save_file({f"{key}.lora_A.weight": np.zeros((2, D), np.float32),
               f"{key}.lora_B.weight": np.zeros((F, 2), np.float32)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"experts of an MoE layer .*layers/0/mlp/down_proj "
                                         r"\[4, 64, 32\].*no LoRA per expert"):
        import_peft(build("qwen3_moe")[0], folder, name_map=name_map)


# ------------------------------------------------------------------ hf tier: real PEFT loads it
HF_INSTALL = "pip install torch transformers peft (CPU wheels are enough)"


def _hf_model(kind):
    """The HF architecture matching ``build(kind)`` (random weights: only names and widths
    matter here)."""
    try:
        import transformers
    except ImportError as err:
        raise AssertionError(f"the hf tier needs torch, transformers and peft: {HF_INSTALL}") \
            from err
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=1,
                  num_attention_heads=N, head_dim=H, pad_token_id=0, attn_implementation="eager",
                  rms_norm_eps=1e-6 if kind.startswith("gemma") else 1e-5,
                  # tunix's Llama 3 / Qwen 3 rotate with base 1e6 whatever config.rope_theta
                  # says (apply_rope's default; found by the logits test below)
                  rope_parameters={"rope_type": "default", "rope_theta": 10_000.0 if
                                   kind.startswith("gemma") else 1_000_000.0})
    if kind == "llama3":
        config = transformers.LlamaConfig(num_key_value_heads=K, tie_word_embeddings=False,
                                          **common)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(num_key_value_heads=K, tie_word_embeddings=False,
                                          **common)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_key_value_heads=K, tie_word_embeddings=False, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=F, decoder_sparse_step=1,
            mlp_only_layers=[], **common)
    else:
        config = transformers.GemmaConfig(num_key_value_heads=1 if kind == "gemma_kv" else N,
                                          **common)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.hf
@pytest.mark.parametrize("kind", FAMILIES + ["qwen3_moe"])
def test_hf_peft_loads_the_export_with_no_missing_or_unexpected_keys(kind, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file

    model, name_map = build(kind)
    rules = [LoRARule("attn/", rank=4, alpha=8.0)] if kind == "qwen3_moe" else [  # experts:
        LoRARule("mlp/down_proj", rank=2), LoRARule(EVERY, rank=4, alpha=8.0)]  # see above
    apply_lora(model, rules, rngs=nnx.Rngs(3))
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(i), layer.lora_b[...].shape)
    export_peft(model, tmp_path, name_map=name_map)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    peft_model = PeftModel.from_pretrained(_hf_model(kind), str(tmp_path))
    result = peft_model.load_adapter(str(tmp_path), adapter_name="again")
    assert not result.unexpected_keys, result.unexpected_keys[:4]
    missing = [k for k in result.missing_keys if "lora_" in k and ".again." in k]
    assert not missing, missing[:4]
    loaded = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "again" in module.lora_A:
            hf = name.removeprefix("base_model.model.")
            loaded[hf] = module
            a = tensors[f"base_model.model.{hf}.lora_A.weight"]
            b = tensors[f"base_model.model.{hf}.lora_B.weight"]
            assert tuple(module.lora_B["again"].weight.shape) == b.shape  # PEFT's widths
            scale = 1.0 if hf.endswith("down_proj") else 2.0  # r / alpha / patterns read right
            with torch.no_grad():
                np.testing.assert_allclose(module.get_delta_weight("again").numpy(),
                                           scale * b @ a, rtol=1e-5, atol=1e-6)
    assert {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in tensors} == set(
        loaded)


@pytest.mark.hf
def test_an_adapter_saved_by_hf_peft_imports_into_gemmas_fused_layout(tmp_path):
    """The import direction on a file PEFT itself wrote: separate k_proj / v_proj adapters (each
    its own A) become one kv_einsum adapter of rank 2r whose k and v slices are PEFT's deltas."""
    import torch
    from peft import LoraConfig, get_peft_model

    hf = get_peft_model(_hf_model("gemma_kv"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "lora_B" in name:
                param.normal_()
    hf.save_pretrained(str(tmp_path))
    model, name_map = build("gemma_kv")
    assert sorted(import_peft(model, tmp_path, name_map=name_map)) == [
        "layers/0/attn/attn_vec_einsum", "layers/0/attn/kv_einsum", "layers/0/attn/q_einsum",
        "layers/0/mlp/up_proj"]
    attn = model.layers[0].attn
    layers = dict(hf.base_model.model.model.layers[0].self_attn.named_children())
    with torch.no_grad():
        theirs = {n: layers[n].get_delta_weight("default").numpy()
                  for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        up = hf.base_model.model.model.layers[0].mlp.up_proj.get_delta_weight("default").numpy()
    assert attn.kv_einsum.rank == 8  # k and v had their own A
    kv = np.asarray(attn.kv_einsum.delta()).T
    np.testing.assert_allclose(kv[:H], theirs["k_proj"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kv[H:], theirs["v_proj"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(attn.q_einsum.delta()).T, theirs["q_proj"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(attn.attn_vec_einsum.delta()).T, theirs["o_proj"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.layers[0].mlp.up_proj.delta()).T, up,
                               rtol=1e-5, atol=1e-6)


def _hf_state(model, name_map, kind):
    """The HF state dict holding the tunix model's base weights: every projection through the
    same name map as the adapters (a fused kernel split into its HF modules), plus the
    embeddings and norms by hand."""
    import torch

    from lowrank_jax.io.peft_names import targets
    from lowrank_jax.nn import projection_view
    from lowrank_jax.nn.projection import outermost_projections
    from lowrank_jax.nn.projection import module_path

    state = {}
    for path, module in outermost_projections(model):
        path = module_path(path)
        found = targets(path, name_map)
        kernel = module.w if hasattr(module, "w") else module.kernel  # tunix / nnx.Linear
        matrix = np.asarray(projection_view(module).to_matrix(kernel[...]))  # [in, out]
        for target, block in zip(found, np.split(matrix, len(found), axis=1)):
            state[f"{target.name}.weight"] = block.T
    gemma = kind.startswith("gemma")
    state["model.embed_tokens.weight"] = model.embedder.input_embedding[...]
    norm = "scale" if gemma else "w"
    state["model.norm.weight"] = getattr(model.final_norm, norm)[...]
    layer, pre = model.layers[0], "model.layers.0."
    names = (("pre_attention_norm", "input_layernorm"), ("pre_ffw_norm", "post_attention_layernorm")
             ) if gemma else (("input_layernorm", "input_layernorm"),
                              ("post_attention_layernorm", "post_attention_layernorm"))
    for ours, theirs in names:
        state[pre + theirs + ".weight"] = getattr(getattr(layer, ours), norm)[...]
    if kind == "qwen3":
        for n in ("q_norm", "k_norm"):
            state[pre + f"self_attn.{n}.weight"] = getattr(layer.attn, n).w[...]
    return {k: torch.tensor(np.asarray(v, np.float32)) for k, v in state.items()}


@pytest.mark.hf
@pytest.mark.parametrize("kind", FAMILIES)
def test_the_tunix_adapter_gives_tunix_logits_in_hf_peft(kind, tmp_path):
    """End to end on a third-party model: tunix's weights through the name map into the HF
    architecture, the adapter through export_peft into PEFT: PEFT's logits are tunix's."""
    import torch
    from peft import PeftModel

    base, name_map = build(kind)
    hf = _hf_model(kind)
    missing, unexpected = hf.load_state_dict(_hf_state(base, name_map, kind), strict=False)
    assert not unexpected and all("rotary" in k or k == "lm_head.weight" for k in missing), (
        missing, unexpected)
    hf.tie_weights()
    model, _ = build(kind)
    apply_lora(model, LoRARule(EVERY, rank=4, alpha=8.0), rngs=nnx.Rngs(3))
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(i), layer.lora_b[...].shape)
    ours = np.asarray(forward(model))
    export_peft(model, tmp_path, name_map=name_map)
    peft_model = PeftModel.from_pretrained(hf.eval(), str(tmp_path)).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(np.asarray(TOKENS[:, :-1]), dtype=torch.long))
    np.testing.assert_allclose(theirs.logits.numpy(), ours, rtol=2e-4, atol=2e-4)
