"""Sharding from metadata and projection views: kernels of any rank, adapters, scanned stacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lowrank_jax.nn import apply_lora
from lowrank_jax.nn.projection import ProjectionView
from lowrank_jax.train import sharding


class EinsumAttention(nnx.Module):
    """Written like the ecosystem's attention: einsum kernels [D, N, H] and [N, H, D]."""

    def __init__(self, d=64, heads=8, head_dim=16, *, rngs):
        self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (d, heads, head_dim), rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, d), rngs=rngs)
        self.odd = nnx.Param(jnp.ones((7, 1024)))  # no rule, no view: reported

    def __call__(self, x):
        return self.attn_vec_einsum(jax.nn.relu(self.q_einsum(x)))


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(2, 2, 2)


def spec_of(variable):
    return variable[...].sharding.spec


def test_einsum_kernel_and_its_adapter_are_sharded_not_replicated(mesh):
    model = EinsumAttention(rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 64))
    apply_lora(model, {"q_einsum|attn_vec_einsum": 4}, rngs=nnx.Rngs(2))
    before = model(x)
    with pytest.warns(UserWarning, match="odd"):
        replicated = sharding.shard_model(model, mesh)
    assert replicated == ["odd (7, 1024)"]
    q, o = model.q_einsum, model.attn_vec_einsum
    assert spec_of(q.base.kernel) == P("fsdp", "tensor", None)  # contracted D, free N (first)
    # [N, H, D]: contracted N, H (the first that divides: N) -> fsdp; free D -> tensor
    assert spec_of(o.base.kernel) == P("fsdp", None, "tensor")
    for factor in (q.lora_a, q.lora_b, o.lora_a, o.lora_b):
        assert any(axis is not None for axis in spec_of(factor)), factor
    # each device holds a quarter of the kernel, and the model still computes the same
    shard = q.base.kernel[...].addressable_shards[0].data
    assert shard.shape == (32, 4, 16)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(before), rtol=1e-5, atol=1e-5)


def test_logical_axis_metadata_wins_over_the_view(mesh):
    with nnx.use_eager_sharding(False):
        layer = nnx.Einsum("BTD,DNH->BTNH", (64, 8, 16), rngs=nnx.Rngs(0),
                           kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                             ("embed", "heads", "head_dim")))
    assert sharding.logical_names(nnx.state(layer)) == {("kernel",): ("embed", "heads",
                                                                      "head_dim")}
    specs = sharding.param_shardings(nnx.state(layer), mesh, model=layer,
                                     rules={**sharding.LOGICAL_RULES, "embed": "tensor",
                                            "heads": "fsdp"})
    assert specs["kernel"].spec == P("tensor", "fsdp", None)


def test_rules_keep_each_mesh_axis_once_and_skip_what_does_not_divide(mesh):
    assert sharding.spec_from_logical(("mlp", "heads"), (8, 8), mesh) == P("tensor", None)
    assert sharding.spec_from_logical(("embed", "mlp"), (5, 8), mesh) == P(None, "tensor")
    view = ProjectionView.from_equation("...i,io->...o", (64, 6))
    assert sharding.view_spec(view, (3, 64, 6), mesh) == P(None, "fsdp", "tensor")
    odd = ProjectionView.from_equation("...i,io->...o", (64, 5))
    assert sharding.view_spec(odd, (64, 5), mesh) == P("fsdp", None)


def test_scanned_stacks_shard_their_matrix_axes():
    stack = ("layers", "mlp", "up_proj", "kernel")
    assert sharding.logical_spec([jax.tree_util.DictKey(k) for k in stack],
                                 (4, 32, 64)) == P(None, "fsdp", "tensor")
