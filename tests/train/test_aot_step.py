"""``lowrank-jax compile``: pretrain's real step compiled for a TPU topology on this CPU host.

The compile needs libtpu (``pip install -e ".[tpu]"``); without it these tests fail with that
line (``pallas_kernels.aot.TopologyError``).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.cli import main as cli_main
from lowrank_jax.train.aot_step import compile_pretrain_step, suggest_mesh, topology_mesh
from lowrank_jax.train.config import load_config
from lowrank_jax.train.plan import plan_memory, tpu_padded_bytes

# its module-scoped fixture is built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("train.test_aot_step")

SMALL = ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=128", "model.max_seq_len=64", "train.seq_len=64", "train.batch_size=8",
         "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


@pytest.fixture(scope="module")
def small_compile():
    """The tiny preset's step (factorized, Spectron + AdamW) at 1 layer, on a v5e-8 mesh."""
    return compile_pretrain_step(load_config("tiny", SMALL), "v5e-8", config="small")


def test_compiled_arguments_equal_the_plan_on_v5e_8(small_compile):
    report = small_compile
    assert report.devices == 8 and report.mesh == {"data": 2, "fsdp": 2, "tensor": 2}
    assert report.topology == "v5e:2x4" and report.chip == "v5e"
    compiled = report.memory["argument_bytes"]
    # params + Spectron/AdamW state on the rules' shards, TPU-padded, + the int32 batch: the
    # plan and the compiler agree to the byte here (tolerance stated in docs/guides/pod.md: 1%)
    assert abs(compiled - report.planned_argument_bytes) <= 0.01 * compiled, (
        compiled, report.planned_argument_bytes)
    assert compiled == report.planned_argument_bytes
    # the packed (unpadded) plan is far lower at these thin shapes: the padding is real
    packed = plan_memory(load_config("tiny", SMALL), 8).state_bytes_per_device
    assert packed < 0.75 * report.plan.state_bytes_per_device
    # nothing replicated by accident: less than the whole (one-device) state
    whole = plan_memory(load_config("tiny", SMALL[:-3]), 1, layout="tpu").state_bytes_per_device
    assert compiled < whole


def test_the_report_prints_memory_against_hbm_and_flops(small_compile):
    text = small_compile.table()
    for line in ("arguments (params, optimizer, batch)", "temporaries", "generated code",
                 "of TPU v5e's 16 GiB HBM", "FLOPs per device per step: compiled"):
        assert line in text, text
    assert small_compile.fits and text.rstrip().endswith("fits")
    # XLA counts everything (optimizer, masked full attention); the model count is its matmuls
    assert small_compile.model_flops < small_compile.compiled_flops < 4 * small_compile.model_flops


def test_a_step_too_big_for_the_chip_is_one_line_and_status_2(capsys):
    args = ["compile", "--config", "tiny", "--topology", "v5e-8"] + [
        f"--set={s}" for s in SMALL[:-3] + ["mesh.data=8", "model.vocab_size=2097152",
                                             "model.d_model=1024", "model.n_heads=8",
                                             "model.n_kv_heads=8", "model.d_ff=1024"]]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "lowrank-jax compile: error: tiny does not fit TPU v5e (16 GiB HBM): RESOURCE_EXHAUSTED"
    ), err


def test_a_mesh_that_does_not_cover_the_topology_suggests_one():
    cfg = load_config("tpu_v5e_256")
    with pytest.raises(ValueError, match=r"mesh data=1 x fsdp=64 x tensor=4 = 256 devices, "
                       r"but topology 'v5e-8' has 8; .* `mesh.data=1` `mesh.fsdp=2` "
                       r"`mesh.tensor=4`"):
        topology_mesh(cfg, "v5e-8")
    assert suggest_mesh(load_config("tiny", ["mesh.tensor=3"]), 8).endswith(
        "`mesh.fsdp=8` `mesh.tensor=1`")


def test_without_libtpu_one_line_says_how_to_install_it(monkeypatch, capsys):
    from pallas_kernels import aot

    monkeypatch.setattr(aot, "has_libtpu", lambda: False)
    assert cli_main(["compile", "--config", "tiny", "--topology", "v5e-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install -e ".[tpu]"' in err[0], err


def test_tpu_padding_rule_matches_the_compiler_on_single_arrays():
    from pallas_kernels import aot

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as topology_mesh does
    for shape, dtype in [((64, 32), jnp.float32), ((2000,), jnp.float32), ((), jnp.int32),
                         ((96, 640), jnp.bfloat16), ((2, 200), jnp.float32)]:
        compiled = aot.compile_for_tpu(lambda x: x * 2, jax.ShapeDtypeStruct(shape, dtype),
                                       topology="v5e:2x2")
        assert compiled.memory_analysis().argument_size_in_bytes == tpu_padded_bytes(
            shape, jnp.dtype(dtype).itemsize), shape


def test_remat_keeps_loss_and_gradients_and_the_plan_follows_it():
    from lowrank_jax.models.llama import Llama, LlamaConfig
    from lowrank_jax.train.losses import lm_loss

    x = jnp.arange(16).reshape(2, 8) % 64
    results = []
    for remat in (False, True):
        cfg = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=64, projection="factorized", remat=remat)
        graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        grad = jax.value_and_grad(lm_loss(graphdef))
        results.append(jax.jit(grad)(params, x, x))
        assert ("remat" in str(jax.make_jaxpr(grad)(params, x, x))) == remat
    (loss0, g0), (loss1, g1) = results
    assert float(loss0) == float(loss1)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert all(load_config(name).model.remat for name in ("tpu_v5e_256", "gpu_8xh200", "1b"))
    small = load_config("tiny", SMALL[:-3] + ["model.n_layers=8", "model.remat=true"])
    assert plan_memory(small, 1).remat and not plan_memory(small, 1, remat=False).remat
    assert plan_memory(small, 1, remat=False).activation_bytes_per_device > 2 * (
        plan_memory(small, 1).activation_bytes_per_device)


def test_without_the_cuda_plugin_one_line_says_how_to_install_it(monkeypatch, capsys):
    from jax.experimental import topologies

    def no_plugin(*args, **kwargs):  # what jax raises when no CUDA plugin is installed
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    assert cli_main(["compile", "--config", "tiny", "--topology", "8xh200",
                     "--set", "mesh.fsdp=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pip install jax-cuda12-plugin=={jax.__version__}" in err[0], err


def test_gpu_target_configs_name_the_chip_and_its_memory():
    from lowrank_jax.models.flops import CHIPS
    from lowrank_jax.train.aot_step import gpu_target_config, gpu_topology

    text = gpu_target_config("h200")
    assert 'device_description_str: "NVIDIA H200"' in text
    assert f"device_memory_size: {CHIPS['h200'].hbm_bytes}" in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert gpu_topology("16xH100") == (16, "h100") and gpu_topology("v5e-8") is None


@pytest.mark.cuda_plugin
def test_the_step_compiles_for_8_h200_without_a_gpu():
    """Needs the CUDA plugin of the installed jax (no GPU, no driver):
    pip install jax-cuda12-plugin==<jax version>; run with python -m pytest -m cuda_plugin."""
    cfg = load_config("tiny", SMALL[:-3] + ["mesh.fsdp=8"])
    report = compile_pretrain_step(cfg, "8xh200", config="small")
    assert report.devices == 8 and report.chip == "h200" and report.fits
    # no TPU padding on a GPU: the compiled arguments are the packed shards of the rules
    assert report.memory["argument_bytes"] == report.planned_argument_bytes
    assert "of NVIDIA H200's 140.4 GiB HBM" in report.table()


def test_the_pod_configs_name_their_topology_and_others_need_one(capsys):
    assert load_config("tpu_v5e_256").topology == "v5e-256"
    assert load_config("gpu_8xh200").topology == "8xh200"
    assert cli_main(["compile", "--config", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lowrank-jax compile: error: --topology is needed: config 'tiny' names none "
                   "(e.g. --topology v5e-8, or topology: v5e-8 in the config)."], err
