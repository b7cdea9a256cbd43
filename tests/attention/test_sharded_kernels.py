"""Kernels inside a sharded model: the dispatcher's flash / SALE entries under a mesh.

Mosaic and Triton kernels are not auto-partitioned, so under a mesh the dispatcher runs them in
``jax.shard_map`` over batch (data, fsdp) and heads (tensor). On CPU the entries run the
reference per shard (``implementation="auto"``), which must equal the unsharded result; the TPU
test compiles SmolLM2's architecture with the flash kernel for a v5e-8 topology under a
data × fsdp × tensor mesh (libtpu: ``pip install -e ".[tpu]"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from lowrank_jax.attention import get_attention, reference_attention
from lowrank_jax.attention.kernels import kernel_partition, run_sharded

pytestmark = pytest.mark.xdist_group("attention.test_sharded_kernels")

#: SmolLM2-135M's architecture (design.md "Real data and real models").
SMOLLM2 = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
               rope_theta=1e5, max_seq_len=2048)


def test_kernel_partition_splits_batch_and_heads_only_where_they_divide():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert kernel_partition(mesh, 8, 32, 8) == (("data", "fsdp"), "tensor",
                                                ("data", "fsdp", "tensor"))
    assert kernel_partition(mesh, 2, 9, 3) == (("data",), None, ("data", "fsdp", "tensor"))
    assert kernel_partition(mesh, 3, 4, 2) == ((), "tensor", ("data", "fsdp", "tensor"))
    single = AbstractMesh((1, 8), ("data", "tensor"))
    assert kernel_partition(single, 4, 8, 8) == ((), "tensor", ("tensor",))


def test_flash_and_sale_entries_under_a_mesh_equal_the_unsharded_result():
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((4, 24, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((4, 24, 2, 16)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (4, 24)), axis=1))
    masks = dict(window=6, logit_softcap=2.0, segment_ids=(seg, seg))
    flash, sale = get_attention("flash"), get_attention("sale")

    @jax.jit
    def both(q, k, v):
        return flash(q, k, v, **masks), sale(q, k, v)

    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(both)(q, k, v))
        got_flash, got_sale = both(q, k, v)
    assert jaxpr.count("shard_map") >= 2
    np.testing.assert_allclose(got_flash, reference_attention(q, k, v, **masks), atol=1e-5)
    np.testing.assert_allclose(got_sale, reference_attention(q, k, v), atol=1e-5)


def test_run_sharded_is_a_plain_call_without_a_mesh():
    x = jnp.ones((2, 3, 4, 8))
    assert run_sharded(lambda q, k, v: q + k + v, x, x, x).shape == x.shape
    assert "shard_map" not in str(jax.make_jaxpr(
        lambda x: run_sharded(lambda q, k, v: q * 2, x, x, x))(x))


def _compile_smollm2(n_layers: int):
    """Forward and one training step of SmolLM2's architecture (``n_layers`` of it), flash
    attention, compiled for v5e-8 under data 2 × fsdp 2 × tensor 2; abstract params."""
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding

    from lowrank_jax.core.step import make_step
    from lowrank_jax.models.llama import Llama, LlamaConfig
    from lowrank_jax.train import sharding as shard_lib
    from lowrank_jax.train.losses import lm_loss
    from pallas_kernels import aot

    mesh = aot.tpu_mesh("v5e-8", {"data": 2, "fsdp": 2, "tensor": 2})
    cfg = LlamaConfig(**{**SMOLLM2, "n_layers": n_layers}, attention="flash", dtype="bfloat16")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    tx = optax.adamw(1e-4)
    opt_state = jax.eval_shape(tx.init, params)
    param_sh = shard_lib.param_shardings(params, mesh)
    opt_sh = shard_lib.state_shardings(opt_state, params, mesh)
    batch_sh = NamedSharding(mesh, P(("data", "fsdp"), None))
    tokens = jax.ShapeDtypeStruct((4, 512), jnp.int32)

    def forward(params, inputs):
        return nnx.merge(graphdef, params)(inputs)[0]

    step = make_step(lm_loss(graphdef), tx)
    fwd = aot.compile_for_tpu(forward, params, tokens, mesh=mesh,
                              in_shardings=(param_sh, batch_sh))
    train = aot.compile_for_tpu(step, params, opt_state, tokens, tokens, mesh=mesh,
                                in_shardings=(param_sh, opt_sh, batch_sh, batch_sh))
    return fwd, train


def _check_smollm2(n_layers: int):
    from pallas_kernels import aot

    if not aot.has_libtpu():
        pytest.fail('compiling for TPU needs libtpu on this host: pip install -e ".[tpu]"')
    fwd, train = _compile_smollm2(n_layers)
    # one forward kernel per layer; the step adds the dq and dk/dv kernels
    assert aot.kernel_calls(fwd, "tpu") >= n_layers
    assert aot.kernel_calls(train, "tpu") >= 3 * n_layers
    assert aot.memory_report(train)["argument_bytes"] > 0


def test_flash_entry_compiles_per_shard_on_a_sharded_v5e_8():
    """The dispatcher's flash entry, forward and gradient, compiled for v5e-8 under
    data 2 × fsdp 2 × tensor 2 with sharded inputs: the kernels are in the module (the
    default-suite version of the SmolLM2 compile below, which takes minutes)."""
    from jax.sharding import NamedSharding

    from pallas_kernels import aot

    if not aot.has_libtpu():
        pytest.fail('compiling for TPU needs libtpu on this host: pip install -e ".[tpu]"')
    mesh = aot.tpu_mesh("v5e-8", {"data": 2, "fsdp": 2, "tensor": 2})
    flash = get_attention("flash")
    q = jax.ShapeDtypeStruct((4, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 256, 2, 64), jnp.bfloat16)
    spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))

    def loss(q, k, v):
        return jnp.sum(flash(q, k, v).astype(jnp.float32))

    compiled = aot.compile_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, mesh=mesh,
                                   in_shardings=(spec, spec, spec))
    assert aot.kernel_calls(compiled, "tpu") >= 3  # forward, dq, dk/dv
    text = compiled.as_text()
    assert "bf16[1,256,2,64]" in text  # the per-shard q: batch 4/4, heads 4/2


@pytest.mark.slow
def test_smollm2_compiles_with_the_flash_kernel_on_a_sharded_v5e_8():
    """SmolLM2's 30 layers, forward and one AdamW step (minutes on a CPU host)."""
    _check_smollm2(SMOLLM2["n_layers"])
