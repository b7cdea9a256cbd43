"""QLoRA on the (data, fsdp, tensor) mesh of 8 simulated devices equals one device; codes,
scales and adapters keep their shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.nn import apply_lora
from lowrank_jax.quantize.qlora_base import quantize_base
from lowrank_jax.train import sharding

CFG = LlamaConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128,
                  max_seq_len=32)
DATA = jax.random.randint(jax.random.PRNGKey(7), (1, 8, 13), 0, 64)


def train(method, mesh=None, steps=3):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    quantize_base(model, method)
    apply_lora(model, {r"(q|v|o|up|down)_proj": 4}, rngs=nnx.Rngs(1))
    graph, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    # a nonzero B, so that every factor gets a gradient from the first step
    lora = jax.tree.map(lambda x: x + 0.05 if x.ndim == 2 and x.shape[0] == 4 else x, lora)
    tx = optax.adam(1e-2)

    def loss_fn(lora, frozen, x, y):
        logits = nnx.merge(graph, lora, frozen)(x)[0]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    put = lambda tree: tree
    if mesh is not None:
        lora = jax.device_put(lora, sharding.param_shardings(lora, mesh))
        frozen = jax.device_put(frozen, sharding.param_shardings(frozen, mesh))
        put = lambda a: jax.device_put(a, sharding.batch_sharding(mesh))
    opt = tx.init(lora)

    @jax.jit
    def step(lora, opt, frozen, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(lora, frozen, x, y)
        updates, opt = tx.update(grads, opt, lora)
        return optax.apply_updates(lora, updates), opt, loss

    losses = []
    for _ in range(steps):
        lora, opt, loss = step(lora, opt, frozen, put(DATA[0, :, :-1]), put(DATA[0, :, 1:]))
        losses.append(float(loss))
    return losses, lora, frozen


def spec(tree, *names):
    leaf = tree
    for n in names:
        leaf = leaf[n]
    value = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
    spec = tuple(value.sharding.spec)
    return P(*(spec + (None,) * (value.ndim - len(spec))))  # jit drops trailing Nones


@pytest.mark.parametrize("method,codes", [("rtn4", "codes"),
                                          pytest.param("nf4", "packed", marks=pytest.mark.slow)])
def test_sharded_qlora_equals_one_device(method, codes):
    single, lora_1, _ = train(method)
    mesh = sharding.make_mesh(2, 2, 2)
    losses, lora, frozen = train(method, mesh)
    np.testing.assert_allclose(losses, single, rtol=1e-5)
    assert losses[-1] < losses[0]
    up = ("layers", 0, "mlp", "up_proj")
    assert spec(frozen, *up, "base", codes) == P(("tensor", "fsdp"), None)
    assert spec(frozen, "layers", 0, "mlp", "down_proj", "base", codes) == P("fsdp", None)
    scale = "scale" if method == "rtn4" else "absmax"
    assert spec(frozen, *up, "base", scale) == P(("tensor", "fsdp"), None)
    assert spec(lora, *up, "lora_a") == P("fsdp", None)  # adapters keep the LoRA rules
    assert spec(lora, *up, "lora_b") == P(None, ("tensor", "fsdp"))
    b1 = lora_1["layers"][0]["mlp"]["up_proj"]["lora_b"]
    b8 = lora["layers"][0]["mlp"]["up_proj"]["lora_b"]
    np.testing.assert_allclose(np.asarray(b8[...] if isinstance(b8, nnx.Variable) else b8),
                               np.asarray(b1[...] if isinstance(b1, nnx.Variable) else b1),
                               rtol=1e-4, atol=1e-6)
