"""Sharded training on 8 simulated CPU devices matches one device; checkpoints reshard."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.train import load_config, train
from lowrank_jax.train import sharding
from lowrank_jax.train.config import MeshConfig
from lowrank_jax.train.loop import init_state

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("train.test_sharding")

SMALL = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
    "model.d_ff=64", "model.max_seq_len=16", "train.seq_len=16", "train.batch_size=8",
    "train.eval_batches=1", "train.eval_every=100", "train.checkpoint_every=100",
    "train.log_every=1", "train.steps=20", "optimizer.name=spectron",
]


def run(tmp_path, mesh, steps=None, resume=False, stop_after=None, name=None):
    cfg = load_config("tiny", SMALL + [f"run_dir={tmp_path / (name or str(mesh))}"])
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(*mesh))
    return train(cfg, progress=False, log=lambda *_: None, resume=resume, stop_after=stop_after)


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), (1, 1, 1)).losses


@pytest.mark.parametrize("mesh", [  # all three axes at once in the default run, the rest slow
    pytest.param((8, 1, 1), marks=pytest.mark.slow),
    pytest.param((2, 4, 1), marks=pytest.mark.slow),
    (2, 2, 2), pytest.param((1, 1, 8), marks=pytest.mark.slow)])
def test_sharded_losses_match_single_device(tmp_path, single_device_losses, mesh):
    result = run(tmp_path, mesh)
    np.testing.assert_allclose(result.losses, single_device_losses, rtol=1e-5)
    # parameters really are distributed as the rules say
    leaf = result.state.params["layers"][0]["mlp"]["up_proj"]["a"]
    value = leaf[...] if isinstance(leaf, nnx.Variable) else leaf
    assert value.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)


@pytest.mark.slow  # tests/multihost moves checkpoints between meshes and processes by default
def test_checkpoint_from_222_restores_on_811(tmp_path, single_device_losses):
    first = run(tmp_path, (2, 2, 2), stop_after=10, name="ckpt")
    assert first.state.step == 10
    resumed = run(tmp_path, (8, 1, 1), resume=True, name="ckpt")
    np.testing.assert_allclose(resumed.losses, single_device_losses[10:], rtol=1e-5)


def test_mesh_errors_name_both_numbers():
    with pytest.raises(ValueError, match="needs 12 devices, but 8 are available"):
        sharding.make_mesh(3, 2, 2)
    mesh = sharding.make_mesh(1, 1, 8)
    cfg = load_config("tiny", SMALL + ["model.d_ff=60"])
    with pytest.raises(ValueError, match=r"down_proj/a dimension 60 is not divisible "
                                         r"by mesh axis tensor\*fsdp=8"):
        init_state(cfg, mesh)
    assert sharding.parse_mesh("data=2,tensor=4") == {"data": 2, "fsdp": 1, "tensor": 4}
    with pytest.raises(ValueError, match="unknown axis 'model'"):
        sharding.parse_mesh("model=2")
