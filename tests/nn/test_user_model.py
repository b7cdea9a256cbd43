"""LoRA, factorization, QLoRA and PEFT on a model the library did not define.

``UserLM`` is written the way the JAX LLM ecosystem (tunix, gemma, MaxText) writes a Llama: the
attention projections are einsum modules with multi-dimensional kernels (a tunix-style duck-typed
``Einsum`` with ``einsum_str`` + ``w``, and flax's own ``nnx.Einsum``), the output projection is an
``nnx.LinearGeneral`` over ``(heads, head_dim)``, grouped-query attention, an ``nnx.Linear`` MLP,
and every kernel is zero-initialised, as the skeleton of a checkpoint to be loaded is. Every test
fails if any part falls back to the MLP only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax.io.peft import export_peft, import_peft
from lowrank_jax.nn import (
    LoRAProjection,
    LoRARule,
    apply_lora,
    factorize,
    dense_matrix,
    lora_layers,
    merge_lora,
    projection_paths,
    projection_view,
    unmerge_lora,
)
from lowrank_jax.nn.merge import merge_adapters
from lowrank_jax.optim import balora, find_pairs, spectron_with_adamw
from lowrank_jax.quant import QuantizedProjection, quantize_projections

D, N, K, H, F, V, LAYERS = 64, 4, 2, 16, 128, 97, 2
ZEROS = nnx.initializers.zeros_init()


class Einsum(nnx.Module):
    """tunix's einsum layer: a kernel ``w`` and an einsum string (found by duck typing)."""

    def __init__(self, einsum_str, shape, *, rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(ZEROS(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = Einsum("BTD,DNH->BTNH", (D, N, H), rngs=rngs)
        self.k_proj = nnx.Einsum("BTD,DKH->BTKH", (D, K, H), kernel_init=ZEROS, rngs=rngs)
        self.v_proj = Einsum("BTD,DKH->BTKH", (D, K, H), rngs=rngs)
        self.o_proj = nnx.LinearGeneral((N, H), D, axis=(-2, -1), use_bias=False,
                                        kernel_init=ZEROS, rngs=rngs)

    def __call__(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)  # GQA
        t = x.shape[1]
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / jnp.sqrt(H)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        out = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, rngs):
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, kernel_init=ZEROS, rngs=rngs)
        self.gate_proj, self.up_proj, self.down_proj = lin(D, F), lin(D, F), lin(F, D)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.attn, self.mlp = Attention(rngs), MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class UserLM(nnx.Module):
    def __init__(self, rngs):
        self.embedder = nnx.Embed(V, D, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embedder.attend(self.final_norm(x))


def load_checkpoint(model, seed=0):
    """Fill the zero skeleton with fixed random weights (what loading a checkpoint does)."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(
        1.0 + 0 * x if x.ndim == 1 else rng.normal(0, 0.5 / np.sqrt(x.shape[0]), x.shape),
        x.dtype), state)
    return nnx.merge(graphdef, state)


def user_model(seed=0):
    return load_checkpoint(UserLM(nnx.Rngs(0)), seed)


TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, V, (4, 17)), jnp.int32)
ALL = r"(q|k|v|o|gate|up|down)_proj"
PER_LAYER = ["attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj",
             "mlp/up_proj", "mlp/down_proj"]
# nnx.iter_modules walks attributes in sorted order
PATHS = sorted(f"layers/{i}/{p}" for i in range(LAYERS) for p in PER_LAYER)


def loss_fn(model):
    logits = model(TOKENS[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()


def train(model, tx, wrt, steps):
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)]


def test_the_protocol_sees_all_seven_projections_and_their_hf_layout():
    model = user_model()
    assert projection_paths(model) == PATHS
    q = model.layers[0].attn.q_proj
    # [D, N, H] viewed as [in, out] = [D, N*H]: transposed, HF's q_proj.weight [N*H, D]
    np.testing.assert_array_equal(dense_matrix(q), q.w[...].reshape(D, N * H))
    o = model.layers[0].attn.o_proj
    np.testing.assert_array_equal(dense_matrix(o), o.kernel[...].reshape(N * H, D))
    assert projection_view(model.layers[0].attn.k_proj).out_shape == (K, H)
    view = projection_view(q)
    np.testing.assert_array_equal(view.to_kernel(dense_matrix(q)), q.w[...])


def test_lora_adapts_every_projection_unchanged_at_init_and_trains_attention():
    model = user_model()
    before = model(TOKENS)
    adapted = apply_lora(model, LoRARule(ALL, rank=4), rngs=nnx.Rngs(1))
    assert adapted == PATHS
    kinds = {p.rsplit("/", 1)[-1]: type(m).__name__ for p, m in lora_layers(model)}
    assert kinds["q_proj"] == kinds["o_proj"] == "LoRAProjection" and kinds["up_proj"] == \
        "LoRALinear"
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), np.asarray(before))
    assert len(find_pairs(nnx.state(model, nnx.LoRAParam), kinds=("lora",))) == 14
    kernel_before = np.asarray(model.layers[0].attn.q_proj.base.w[...])
    losses = train(model, optax.adam(3e-3), nnx.LoRAParam, 12)
    assert losses[-1] < losses[0] - 0.1, losses
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.q_proj.base.w[...]),
                                  kernel_before)  # only the adapters trained
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert float(jnp.abs(getattr(model.layers[1].attn, name).lora_b[...]).max()) > 0, name
    # merge folds s·A·B into each kernel in its own layout; unmerge restores it
    adapted_out = np.asarray(model(TOKENS))
    assert merge_lora(model) == 14
    np.testing.assert_allclose(np.asarray(model(TOKENS)), adapted_out, atol=2e-4)
    assert unmerge_lora(model) == 14
    np.testing.assert_allclose(np.asarray(model.layers[0].attn.q_proj.base.w[...]),
                               kernel_before, atol=1e-6)


def test_peft_default_target_q_v_works():
    model = user_model()
    assert apply_lora(model, LoRARule(r"(q|v)_proj"), rngs=nnx.Rngs(0)) == [
        f"layers/{i}/attn/{p}_proj" for i in range(LAYERS) for p in ("q", "v")]
    assert all(isinstance(m, LoRAProjection) for _, m in lora_layers(model))


@pytest.mark.slow
def test_balora_trains_the_einsum_adapters_balanced():
    from lowrank_jax.optim.balora import balancing_gap

    model = user_model()
    apply_lora(model, LoRARule(ALL, rank=4, init="gaussian"), rngs=nnx.Rngs(1))
    losses = train(model, balora(optax.adam(3e-3)), nnx.LoRAParam, 8)
    assert losses[-1] < losses[0], losses
    q = model.layers[0].attn.q_proj
    assert isinstance(q, LoRAProjection)
    assert float(balancing_gap(q.lora_a[...], q.lora_b[...])) < 1e-3


@pytest.mark.slow
def test_factorize_then_spectron_keeps_the_delta_w_bound_and_trains():
    with pytest.raises(ValueError, match="all zeros"):
        factorize(UserLM(nnx.Rngs(0)), ALL, rank_ratio=0.5)  # the skeleton, not loaded
    model = user_model()
    full = factorize(user_model(), ALL, rank_ratio=1.0)
    assert max(r["error"] for r in full.values()) < 1e-5  # full rank: exact
    report = factorize(model, ALL, rank_ratio=0.5)
    assert list(report) == PATHS
    assert report["layers/0/attn/q_proj"]["rank"] == 32 and report["layers/0/attn/k_proj"][
        "rank"] == 16
    assert all(0.0 < r["error"] < 1.0 for r in report.values())
    state = nnx.state(model, nnx.Param)
    assert len(find_pairs(state, kinds=("factor",))) == 14  # attention included
    eta = 0.05
    tx = spectron_with_adamw(eta, 1e-3, ns_coeffs="exact", exact_norm=True)
    q = model.layers[0].attn.q_proj
    before = [np.asarray(q.a[...], np.float64), np.asarray(q.b[...], np.float64)]
    losses = train(model, tx, nnx.Param, 6)
    assert losses[-1] < losses[0], losses
    # one more step by hand: ||ΔW||_2 ≤ eta for the einsum projection's factor pair
    a0, b0 = np.asarray(q.a[...], np.float64), np.asarray(q.b[...], np.float64)
    train(model, tx, nnx.Param, 1)
    a1, b1 = np.asarray(q.a[...], np.float64), np.asarray(q.b[...], np.float64)
    assert np.linalg.norm(a1 @ b1 - a0 @ b0, 2) <= eta * (1 + 1e-4)
    assert not np.allclose(before[0], a1)


def test_qlora_nf4_trains_and_merges_into_fp_and_quantized():
    model = user_model()
    dense_out = np.asarray(model(TOKENS))
    errors = quantize_projections(model, ALL, "nf4")
    assert list(errors) == PATHS and all(0 < e < 0.15 for e in errors.values())
    assert isinstance(model.layers[0].attn.q_proj, QuantizedProjection)
    quant_out = np.asarray(model(TOKENS))
    assert 0 < np.abs(quant_out - dense_out).max() < 0.5
    assert apply_lora(model, LoRARule(ALL, rank=4), rngs=nnx.Rngs(2)) == PATHS
    np.testing.assert_array_equal(np.asarray(model(TOKENS)), quant_out)  # B = 0 at init
    codes = np.asarray(model.layers[0].attn.q_proj.base.quantized.packed[...])
    losses = train(model, optax.adam(3e-3), nnx.LoRAParam, 10)
    assert losses[-1] < losses[0] - 0.1, losses
    np.testing.assert_array_equal(
        np.asarray(model.layers[0].attn.q_proj.base.quantized.packed[...]), codes)
    adapted_out = np.asarray(model(TOKENS))
    import copy

    fp = copy.deepcopy(model)
    assert set(merge_adapters(fp, target="fp").values()) == {0.0}
    np.testing.assert_allclose(np.asarray(fp(TOKENS)), adapted_out, atol=2e-4)
    requant = merge_adapters(model, target="quantized")
    assert all(0 < e < 0.15 for e in requant.values())
    assert isinstance(model.layers[0].attn.q_proj, QuantizedProjection)
    assert np.abs(np.asarray(model(TOKENS)) - adapted_out).max() < 0.5


def test_peft_export_import_round_trip_is_exact_with_hf_names(tmp_path):
    from safetensors.numpy import load_file

    model = user_model()
    apply_lora(model, LoRARule(ALL, rank=4), rngs=nnx.Rngs(3))
    train(model, optax.adam(3e-3), nnx.LoRAParam, 3)
    config = export_peft(model, tmp_path / "adapter", name_map="llama")
    assert sorted(config["target_modules"]) == sorted(p.split("/")[-1] for p in PER_LAYER)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    pre = "base_model.model.model.layers.1."
    assert tensors[pre + "self_attn.q_proj.lora_B.weight"].shape == (N * H, 4)  # [out, r]
    assert tensors[pre + "self_attn.k_proj.lora_B.weight"].shape == (K * H, 4)
    assert tensors[pre + "self_attn.o_proj.lora_A.weight"].shape == (4, N * H)  # [r, in]
    assert tensors[pre + "mlp.down_proj.lora_A.weight"].shape == (4, F)
    assert len(tensors) == 2 * 14
    fresh = user_model()
    assert sorted(import_peft(fresh, tmp_path / "adapter", name_map="llama")) == PATHS
    np.testing.assert_array_equal(np.asarray(fresh(TOKENS)), np.asarray(model(TOKENS)))
    for (p, a), (_, b) in zip(lora_layers(model), lora_layers(fresh)):
        np.testing.assert_array_equal(np.asarray(a.lora_a[...]), np.asarray(b.lora_a[...]))
        np.testing.assert_array_equal(np.asarray(a.lora_b[...]), np.asarray(b.lora_b[...]))
    # the HF [out, in] delta of the q projection is the flattened [D, N, H] kernel delta
    q = model.layers[0].attn.q_proj
    delta_hf = (tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
                @ tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    np.testing.assert_allclose(delta_hf.T * q.scaling, np.asarray(q.delta()), rtol=1e-5,
                               atol=1e-7)


def test_what_the_protocol_cannot_handle_is_said_clearly(tmp_path):
    class PerHead(nnx.Module):
        def __init__(self):
            self.einsum_str = "BTNH,NHK->BTNK"  # per-head weights: N is a batch axis
            self.w = nnx.Param(jnp.ones((2, 3, 4)))

    with pytest.raises(ValueError, match="batch axes"):
        apply_lora(PerHead(), LoRARule("w|"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="matches no projection"):
        apply_lora(user_model(), LoRARule("qkv_fused"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no entry maps"):
        model = user_model()
        apply_lora(model, LoRARule("q_proj"), rngs=nnx.Rngs(0))
        export_peft(model, tmp_path / "never-written", name_map={r"blocks/(\d+)": r"h.\1"})


def test_flax_lora_layers_are_seen_by_the_pair_finder():
    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.LoRALinear(8, 16, lora_rank=2, rngs=rngs)
            self.side = nnx.LoRA(16, 2, 8, rngs=rngs)

    model = Tiny(nnx.Rngs(0))
    pairs = find_pairs(nnx.state(model, nnx.LoRAParam), kinds=("lora",))
    assert [tuple(str(x) for x in a) for a, _ in pairs] == [("side", "lora_a"),
                                                          ("up", "lora", "lora_a")]
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8))
    tx = balora(optax.sgd(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    target = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
    grads = nnx.grad(lambda m: jnp.sum((m.side(m.up(x)) - target) ** 2),
                     argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    for _ in range(3):  # B = 0 at init: the inner layer's B gets a gradient from step 2 on
        grads = nnx.grad(lambda m: jnp.sum((m.side(m.up(x)) - target) ** 2),
                         argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        optimizer.update(model, grads)
    from lowrank_jax.optim.balora import balancing_gap

    for m in (model.up.lora, model.side):
        assert float(jnp.abs(m.lora_b[...]).max()) > 0
        scale = float(jnp.linalg.norm(m.lora_a[...]) ** 2)
        assert float(balancing_gap(m.lora_a[...], m.lora_b[...])) < 1e-4 * scale
