"""The three extension points of the one Llama forward: K/V providers, linear layers, capture."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.models.generate import forward, logits_full, prepare
from lowrank_jax.models.llama import KVProvider, Llama, LlamaConfig, replace_projections
from lowrank_jax.nn.capture import Recorder, capture, recording, tapped

CFG = LlamaConfig(vocab_size=40, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                  max_seq_len=32)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 9)), jnp.int32)


def _model(seed=0):
    return Llama(CFG, rngs=nnx.Rngs(seed))


@jax.tree_util.register_static
class LowRankKV(KVProvider):
    """A user-written provider: attend to keys/values projected on their top-``rank`` right
    singular vectors (per layer, per sequence). At full rank it is the exact attention."""

    def __init__(self, rank):
        self.rank = rank

    def __eq__(self, other):
        return type(other) is type(self) and other.rank == self.rank

    def __hash__(self):
        return hash(self.rank)

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        def project(x):  # [b, t, h, d] -> same, rank-r along the flattened features
            b, t, h, d = x.shape
            flat = x.reshape(b, t, h * d)
            _, _, vt = jnp.linalg.svd(flat, full_matrices=False)
            basis = vt[:, : self.rank]
            return (flat @ jnp.swapaxes(basis, 1, 2) @ basis).reshape(b, t, h, d)

        return attention(q, project(k), project(v), causal=True), None

    def advance(self, updates, length):
        return None


def test_custom_kv_provider_equals_exact_attention_at_full_rank():
    model = _model()
    exact, _ = model(TOKENS)
    full_rank = CFG.n_kv_heads * CFG.head_dim
    custom, returned = model(TOKENS, cache=LowRankKV(full_rank))
    assert returned is None
    np.testing.assert_allclose(custom, exact, atol=2e-4)
    # the same provider runs through the scanned forward (one compiled layer)
    static, state = prepare(model)
    assert static.mode == "scan"
    scanned, _ = jax.jit(forward, static_argnums=0)(static, state, TOKENS, LowRankKV(full_rank))
    np.testing.assert_allclose(scanned, exact, atol=2e-4)
    low, _ = model(TOKENS, cache=LowRankKV(1))
    assert float(jnp.max(jnp.abs(low - exact))) > 1e-3  # rank 1 really changes the K/V


class ScaledLinear(nnx.Module):
    """A user-written linear: ``scale · inner(x)``."""

    def __init__(self, inner, scale):
        self.inner = inner
        self.scale = scale

    def __call__(self, x):
        return self.scale * self.inner(x)


def test_custom_linear_behind_a_projection():
    model, reference = _model(1), _model(1)
    replaced = replace_projections(
        model, lambda i, name, lin: ScaledLinear(lin, 2.0) if name == "up_proj" else None)
    assert replaced == ["layers/0/mlp/up_proj", "layers/1/mlp/up_proj"]
    for layer in reference.layers:  # the same map as a dense weight: kernel · 2
        layer.mlp.up_proj.kernel[...] = 2.0 * layer.mlp.up_proj.kernel[...]
    expected, _ = reference(TOKENS)
    np.testing.assert_allclose(model(TOKENS)[0], expected, atol=1e-5)
    np.testing.assert_allclose(logits_full(model, TOKENS), expected, atol=1e-5)  # scanned
    assert float(jnp.max(jnp.abs(expected - _model(1)(TOKENS)[0]))) > 1e-4


def test_capture_sees_the_activations_of_a_plain_forward():
    model = _model(2)
    positions = jnp.broadcast_to(jnp.arange(9)[None], (2, 9))
    # by hand: the input of layer 1's down_proj and the output of layer 0
    h0, _ = model.layers[0](model.embed_tokens(TOKENS), positions)
    layer = model.layers[1]
    x = h0 + layer.self_attn(layer.input_layernorm(h0), positions)[0]
    mlp_in = layer.post_attention_layernorm(x)
    down_in = jax.nn.silu(layer.mlp.gate_proj(mlp_in)) * layer.mlp.up_proj(mlp_in)
    plain, _ = model(TOKENS)
    with capture(model, ["layers/1/mlp/down_proj", "layers/0"], keep_outputs=True) as rec:
        logits, _ = model(TOKENS)
    np.testing.assert_array_equal(logits, plain)  # capturing changes nothing
    np.testing.assert_allclose(rec.inputs["layers/1/mlp/down_proj"][0], down_in, atol=1e-5)
    np.testing.assert_allclose(rec.outputs["layers/0"][0][0], h0, atol=1e-5)
    assert type(model.layers[1].mlp.down_proj) is nnx.Linear  # restored on exit

    # under jit, with a probe: d(sum of logits)/d(probe) is the gradient w.r.t. the output
    path = "layers/1/mlp/down_proj"
    with tapped(model, [path]):
        graph, state = nnx.split(model)

    def loss(probe):
        with recording(Recorder(probes={path: probe})):
            return jnp.sum(nnx.merge(graph, state)(TOKENS)[0] ** 2)

    grad = jax.jit(jax.grad(loss))(jnp.zeros((2, 9, CFG.d_model)))

    def loss_of_output(delta):  # the same gradient by perturbing the layer's output directly
        def hooked(x):
            return nnx.Linear.__call__(model.layers[1].mlp.down_proj, x) + delta
        mlp = model.layers[1].mlp
        layer = model.layers[1]
        x = h0 + layer.self_attn(layer.input_layernorm(h0), positions)[0]
        m = layer.post_attention_layernorm(x)
        out = x + hooked(jax.nn.silu(mlp.gate_proj(m)) * mlp.up_proj(m))
        return jnp.sum(model.logits_from_hidden(model.norm(out)) ** 2)

    np.testing.assert_allclose(grad, jax.grad(loss_of_output)(jnp.zeros_like(grad)),
                               rtol=1e-4, atol=1e-4)
