"""One adapter core (issue 52 Build 1) and swapped-in modules that keep the interface of the module
they replace (issue 49 Build 1): one LoRA body under every adapted layer, factors that carry the
base kernel's logical axes, one merge that keeps dtype and sharding (a quantized base into fp
or re-quantized), the quantized layers registered by ``quant`` without ``nn`` importing it, and a
user's forward that reads ``self.o_proj.shape[1]`` still running after LoRA, factorize and NF4."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.nn import (
    LoRA,
    LoRALinear,
    LoRAProjection,
    QLoRALinear,
    apply_lora,
    factorize,
    lora_layers,
    merge_adapters,
    remove_lora,
)
from lowrank_jax.nn.lokra import LoKRAPlusLinear
from lowrank_jax.nn.multi_lora import MultiLoRALinear
from lowrank_jax.quant import QuantizedProjection, quantize_projections

ROOT = pathlib.Path(__file__).resolve().parents[2]
D, N, H = 64, 4, 16


class OProj(nnx.Module):
    """An ecosystem-style einsum module: a public ``shape`` its owner reads in the forward."""

    def __init__(self, einsum_str, shape, rngs):
        self.einsum_str, self.shape = einsum_str, tuple(shape)
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])


class Attn(nnx.Module):
    """Reads ``self.o_proj.shape[1]`` (the head count) in its forward, as a user model does."""

    def __init__(self, rngs):
        self.q_proj = OProj("BTD,DNH->BTNH", (D, N, H), rngs)
        self.o_proj = OProj("BTNH,NHD->BTD", (N, H, D), rngs)

    def __call__(self, x):
        q = self.q_proj(x)
        heads, head_dim = self.o_proj.shape[0], self.o_proj.shape[1]
        assert q.shape[-2:] == (heads, head_dim)
        return self.o_proj(jax.nn.gelu(q) / heads)


X = jax.random.normal(jax.random.PRNGKey(3), (2, 5, D))


def _nonzero_adapters(model, scale=0.05):
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = scale * jax.random.normal(jax.random.PRNGKey(i), layer.lora_b.shape)


def test_every_adapted_layer_is_the_one_lora_body():
    layers = [LoRALinear(8, 6, rank=2, rngs=nnx.Rngs(0)),
              LoRAProjection(nnx.Einsum("BTD,DNH->BTNH", (8, 2, 3), rngs=nnx.Rngs(0)), rank=2,
                             rngs=nnx.Rngs(1)),
              QLoRALinear(QuantizedProjection.from_projection(
                  nnx.Linear(64, 8, rngs=nnx.Rngs(0)), "nf4"), rank=2, rngs=nnx.Rngs(1))]
    for layer in layers:
        assert isinstance(layer, LoRA)
        # the body's own methods, not a copy per layer
        assert type(layer).delta is LoRA.delta and type(layer).adapter_update is LoRA.adapter_update
        assert type(layer).init_adapter is LoRA.init_adapter
        assert layer.lora_a.shape[1] == layer.lora_b.shape[0] == 2
    # the Khatri-Rao and packed layers keep their own bodies (other math), not a LoRA copy
    assert not issubclass(LoKRAPlusLinear, LoRA) and not issubclass(MultiLoRALinear, LoRA)
    # the standalone body maps [..., in] -> [..., out] and starts at zero, as nnx.LoRA
    body = LoRA(8, 2, 6, alpha=4.0, rngs=nnx.Rngs(0))
    body.lora_b[...] = jnp.ones((2, 6))
    x = jnp.ones((3, 8))
    np.testing.assert_allclose(body(x), 2.0 * (x @ body.lora_a[...]) @ body.lora_b[...],
                               rtol=1e-6)


def test_factors_carry_the_base_kernels_logical_axes():
    with nnx.use_eager_sharding(False):
        q = nnx.Einsum("BTD,DNH->BTNH", (D, N, H), rngs=nnx.Rngs(0),
                       kernel_metadata={"out_sharding": ("embed", "heads", "kv")})
        o = nnx.Einsum("BTNH,NHD->BTD", (N, H, D), rngs=nnx.Rngs(0),
                       kernel_metadata={"out_sharding": (None, "kv", "embed")})
        up = nnx.Linear(D, 2 * D, rngs=nnx.Rngs(0),
                        kernel_metadata={"out_sharding": ("embed", "mlp")})
        lq = LoRAProjection(q, rank=4, rngs=nnx.Rngs(1))
        lo = LoRAProjection(o, rank=4, rngs=nnx.Rngs(1))
        lup = LoRALinear.from_linear(up, rank=4, rngs=nnx.Rngs(1))
        nf4 = QLoRALinear(QuantizedProjection.from_projection(q, "nf4"), rank=4,
                          rngs=nnx.Rngs(1))
        meta = {"kernel_metadata": {"out_sharding": ("embed", "mlp")}}
        packed = MultiLoRALinear(D, 2 * D, ranks=(2, 4), rngs=nnx.Rngs(1), **meta)
        lokra = LoKRAPlusLinear(D, 2 * D, rank1=2, rank2=2, rngs=nnx.Rngs(1), **meta)
    # contracted axes -> the input axis name (leading named one), free -> output, rank: None
    assert lq.lora_a.out_sharding == ("embed", None) and lq.lora_b.out_sharding == (None, "heads")
    assert lo.lora_a.out_sharding == ("kv", None) and lo.lora_b.out_sharding == (None, "embed")
    assert lup.lora_a.out_sharding == ("embed", None)
    assert lup.lora_b.out_sharding == (None, "mlp")
    # a quantized base keeps the names of the kernel it replaced, for the adapters put on it
    assert nf4.lora_a.out_sharding == ("embed", None)
    assert nf4.lora_b.out_sharding == (None, "heads")
    # the packed and Khatri-Rao adapters share the plumbing: same names, adapter axes unsharded
    assert packed.lora_a.out_sharding == (None, "embed", None)
    assert packed.lora_b.out_sharding == (None, None, "mlp")
    assert lokra.lora_a2.out_sharding == ("embed", None)
    assert lokra.lora_b1.out_sharding == (None, "mlp")
    # a kernel without names gives factors without names (replicated, as before)
    plain = LoRAProjection(nnx.Einsum("BTD,DNH->BTNH", (D, N, H), rngs=nnx.Rngs(0)), rank=4,
                           rngs=nnx.Rngs(1))
    assert plain.lora_a.get_metadata().get("out_sharding") is None


def test_factors_are_placed_like_the_kernel_under_a_mesh():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):
        q = nnx.Einsum("BTD,DNH->BTNH", (D, N, H), rngs=nnx.Rngs(0),
                       kernel_metadata={"out_sharding": ("fsdp", "tensor", None)})
        layer = LoRAProjection(q, rank=4, rngs=nnx.Rngs(1))
    assert layer.lora_a[...].sharding.spec == P("fsdp", None)
    assert layer.lora_b[...].sharding.spec == P(None, "tensor")
    assert not layer.lora_a[...].sharding.is_fully_replicated


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_merge_keeps_the_base_kernel_its_dtype_and_its_sharding(dtype):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))

    class M(nnx.Module):
        def __init__(self):
            self.up = nnx.Linear(16, 32, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
            self.q = nnx.Einsum("BTD,DNH->BTNH", (16, 4, 8), dtype=dtype, param_dtype=dtype,
                                rngs=nnx.Rngs(0))

    model = M()
    spec = NamedSharding(mesh, P("fsdp", "tensor"))
    model.up.kernel.set_value(jax.device_put(model.up.kernel[...], spec))
    kernel, q = model.up.kernel, model.q
    apply_lora(model, {"up": 4, "q": 4}, rngs=nnx.Rngs(1))
    _nonzero_adapters(model, 0.5)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 16)).astype(dtype)
    expect_up, expect_q = np.asarray(model.up(x), np.float32), np.asarray(model.q(x), np.float32)
    assert merge_adapters(model) == {"up": 0.0, "q": 0.0}
    assert type(model.up) is nnx.Linear and model.up.kernel is kernel  # the same variable
    assert model.up.param_dtype == dtype and model.up.kernel[...].dtype == dtype
    assert model.up.kernel[...].sharding == spec
    assert model.q is q and model.q.kernel[...].dtype == dtype  # the user's module itself
    tol = 5e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(model.up(x), np.float32), expect_up, atol=tol)
    np.testing.assert_allclose(np.asarray(model.q(x), np.float32), expect_q, atol=tol)


def test_remove_lora_merges_a_quantized_base_into_fp_or_drops_the_adapter():
    def qlora():
        model = Attn(nnx.Rngs(0))
        quantize_projections(model, "proj", "nf4")
        apply_lora(model, "proj", rngs=nnx.Rngs(1))
        _nonzero_adapters(model)
        return model

    model = qlora()
    assert all(isinstance(m, QLoRALinear) for _, m in lora_layers(model))
    adapted = model(X)
    assert remove_lora(model, merge=True) == 2  # was refused for QLoRA layers before
    assert not lora_layers(model)
    np.testing.assert_allclose(model(X), adapted, atol=1e-5)  # fp merge: exact
    assert model.o_proj.shape == (N, H, D) and model.o_proj.einsum_str == "BTNH,NHD->BTD"
    model = qlora()
    base = model.o_proj.base
    assert remove_lora(model, merge=False) == 2 and model.o_proj is base
    errors = merge_adapters(qlora(), target="quantized")
    assert set(errors) == {"q_proj", "o_proj"} and all(0 < e < 0.2 for e in errors.values())


@pytest.mark.parametrize("swap", ["lora", "factorize", "nf4", "nf4+lora", "nf4+lora merged"])
def test_a_user_forward_reading_o_proj_shape_runs_after_each_swap(swap):
    model = Attn(nnx.Rngs(0))
    before = model(X)
    if swap == "lora":
        apply_lora(model, "proj", rngs=nnx.Rngs(1))
        assert isinstance(model.o_proj, LoRAProjection)
    elif swap == "factorize":
        factorize(model, "proj", rank_ratio=1.0)
    else:
        quantize_projections(model, "proj", "nf4")
        if "lora" in swap:
            apply_lora(model, "proj", rngs=nnx.Rngs(1))
        if "merged" in swap:
            merge_adapters(model)
    out = model(X)  # the user's forward: reads self.o_proj.shape[1]
    assert model.o_proj.shape == (N, H, D) and model.q_proj.shape == (D, N, H)
    assert model.o_proj.einsum_str == "BTNH,NHD->BTD"
    tol = 1e-4 if swap in ("lora", "factorize") else 0.15 * float(jnp.abs(before).max())
    np.testing.assert_allclose(out, before, atol=tol)
    with pytest.raises(AttributeError, match="nor had the OProj it replaced"):
        model.o_proj.no_such_attribute  # noqa: B018


def test_swapped_in_modules_read_through_the_flax_attributes():
    class M(nnx.Module):
        def __init__(self):
            self.q = nnx.Einsum("BTD,DNH->BTNH", (64, 2, 32), rngs=nnx.Rngs(0))
            self.o = nnx.LinearGeneral((2, 32), 64, axis=(-2, -1), rngs=nnx.Rngs(0))

    for swap in ("lora", "factorize", "nf4"):
        model = M()
        if swap == "lora":
            apply_lora(model, "q|o", rngs=nnx.Rngs(1))
        elif swap == "factorize":
            factorize(model, "q|o", rank=8)
        else:
            quantize_projections(model, "q|o", "nf4")
        assert model.q.kernel_shape == (64, 2, 32) and model.q.einsum_str == "BTD,DNH->BTNH"
        assert model.q.param_dtype == jnp.float32 and model.o.use_bias is True
        assert model.o.axis == (-2, -1)
        assert model.o.in_features == (2, 32) and model.o.out_features == (64,)


def test_nn_never_imports_quant():
    """``nn`` sits below ``quant``: the quantized layers register themselves with
    ``register_projection``, so no module of ``lowrank_jax/nn`` imports ``lowrank_jax.quant``
    (not even inside a function)."""
    offenders = []
    for path in sorted((ROOT / "lowrank_jax" / "nn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("lowrank_jax.quant")]
    assert offenders == []


def test_finetune_quantize_nf4_save_merged_round_trips(tmp_path):
    """``finetune --model tiny --quantize nf4 --save-merged DIR`` then ``generate --model DIR``:
    the merged folder loads and gives the adapted (QLoRA) model's logits."""
    from lowrank_jax.cli import main
    from lowrank_jax.hub import load_model
    from lowrank_jax.io.peft import import_peft
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.quantize.qlora_base import quantize_base

    out, merged = tmp_path / "run", tmp_path / "merged"
    assert main(["finetune", "--model", "tiny", "--quantize", "nf4", "--steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "--rank", "4", "--lr", "0.05",
                 "--out", str(out), "--save-merged", str(merged), "--no-progress"]) == 0
    assert main(["generate", "--model", str(merged), "--raw", "--prompt", "ab",
                 "--max-new-tokens", "2"]) == 0
    adapted = preset_model("tiny")  # the same NF4 base, with the trained adapter on it
    quantize_base(adapted, "nf4")
    import_peft(adapted, out / "adapter")
    assert any(float(jnp.abs(m.lora_b[...]).max()) > 0 for _, m in lora_layers(adapted))
    loaded, _ = load_model(str(merged))
    assert not lora_layers(loaded)
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % 256
    np.testing.assert_allclose(np.asarray(loaded(tokens)[0]), np.asarray(adapted(tokens)[0]),
                               atol=2e-4)
