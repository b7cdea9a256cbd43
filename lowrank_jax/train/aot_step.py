"""Compile the pretraining step for a TPU pod from a CPU host, before the pod is rented.

``lowrank-jax compile --config NAME --topology v5e-256`` (MaxText's ``train_compile``): the
config's ``(data, fsdp, tensor)`` mesh is laid over the compile-only devices of a TPU topology
(:func:`pallas_kernels.aot.tpu_devices`, libtpu on this host), the state is built abstractly by
:func:`~lowrank_jax.train.loop.init_state` (``abstract=True``: shapes and shardings, nothing
allocated) and the step by :func:`~lowrank_jax.train.loop.pretrain_step`, the very construction
``pretrain`` runs. XLA's TPU compiler then reports what one device holds
(``memory_analysis()``) and what it computes (``cost_analysis()``), next to the analytic plan
(:func:`~lowrank_jax.train.plan.plan_memory`) and FLOP count (:mod:`lowrank_jax.models.flops`).

A step that does not fit the chip's HBM is reported by the compiler itself
(``RESOURCE_EXHAUSTED``); :class:`DoesNotFit` carries its one line.

GPUs (``--topology 8xh200``, ``16xh100``): XLA's GPU compiler runs without a GPU or a driver
when it is given the device's description (a ``GpuTargetConfigProto``, :func:`gpu_target_config`)
through ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``;
it needs the CUDA plugin of the installed jax (``pip install jax-cuda12-plugin==<jax version>``,
no CUDA libraries). XLA's GPU compiler does not refuse a step larger than the GPU (memory is
allocated when it runs): the report's total against the GPU's memory says whether it fits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from lowrank_jax.models.flops import CHIPS, GIB, training_flops_per_token
from lowrank_jax.train import sharding as shard_lib
from lowrank_jax.train.config import RunConfig
from lowrank_jax.train.plan import MemoryPlan, device_bytes, plan_memory


class DoesNotFit(RuntimeError):
    """The compiler refused the step: it does not fit the chip's HBM (``RESOURCE_EXHAUSTED``)."""


#: What XLA's GPU compiler needs to know of a GPU it cannot see (public device properties).
GPU_PROPERTIES = {
    "h100": {"memory_bandwidth": 3352320000000},
    "h200": {"memory_bandwidth": 4800000000000},
}
_GPU_TOPOLOGY = re.compile(r"(\d+)x(h100|h200)")


def gpu_topology(topology: str) -> tuple[int, str] | None:
    """``(gpus, chip)`` of a GPU topology name (``"8xh200"``), ``None`` for anything else.

    Example::

        >>> gpu_topology("8xH200"), gpu_topology("v5e-8")
        ((8, 'h200'), None)
    """
    found = _GPU_TOPOLOGY.fullmatch(topology.strip().lower())
    return None if found is None else (int(found.group(1)), found.group(2))


def gpu_target_config(chip: str) -> str:
    """The ``GpuTargetConfigProto`` (text) of a Hopper GPU in :data:`GPU_PROPERTIES`: sm_90, 132
    SMs, its memory from :data:`~lowrank_jax.models.flops.CHIPS` and its bandwidth."""
    spec = CHIPS[chip]
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": 49152, "shared_memory_per_core": 233472,
        "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128,
        "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": GPU_PROPERTIES[chip]["memory_bandwidth"],
        "l2_cache_size": 52428800, "clock_rate_ghz": 1.98,
        "device_memory_size": spec.hbm_bytes, "shared_memory_per_block_optin": 232448,
        "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
    }
    lines = [f"  {key}: {value}" for key, value in info.items()]
    return ("gpu_device_info {\n" + "\n".join(lines)
            + "\n  cuda_compute_capability { major: 9 minor: 0 }\n}\n"
            "runtime_version { major: 12 minor: 8 }\n"
            'platform_name: "CUDA"\n'
            "dnn_version_info { major: 9 minor: 8 }\n"
            f'device_description_str: "{spec.device_kinds[0]}"\n')


def gpu_devices(topology: str) -> list:
    """The compile-only GPUs of ``"NxCHIP"`` (8 per host) on this host, through the CUDA plugin.

    Raises :class:`pallas_kernels.aot.TopologyError` saying what to install without it.
    """
    from jax.experimental import topologies
    from pallas_kernels.aot import TopologyError

    count, chip = gpu_topology(topology)
    hosts, per_host = -(-count // 8), min(count, 8)
    if hosts * per_host != count:
        raise ValueError(f"topology={topology!r}: more than 8 GPUs come as whole hosts of 8 "
                         f"(e.g. {hosts * 8}x{chip}).")
    try:
        desc = topologies.get_topology_desc(chip, "cuda", target_config=gpu_target_config(chip),
                                            topology=f"1x{hosts}x{per_host}")
    except NotImplementedError as err:
        raise TopologyError(
            "compiling for GPU on a host without one needs the CUDA plugin of your jax "
            f"(no driver or GPU needed): pip install jax-cuda12-plugin=={jax.__version__} "
            f"({err})") from None
    return list(desc.devices)


def topology_chip(topology: str) -> str:
    """The :data:`~lowrank_jax.models.flops.CHIPS` key of a TPU or GPU topology name.

    Example::

        >>> topology_chip("v5e-256"), topology_chip("v5p:2x2x2"), topology_chip("8xh200")
        ('v5e', 'v5p', 'h200')
    """
    from pallas_kernels.aot import topology_name

    if gpu_topology(topology) is not None:
        return gpu_topology(topology)[1]
    chip = topology_name(topology).split(":")[0]
    if chip not in CHIPS:
        raise ValueError(f"topology={topology!r}: no chip {chip!r} in the chip table "
                         f"({', '.join(sorted(CHIPS))}).")
    return chip


def suggest_mesh(cfg: RunConfig, devices: int) -> str:
    """The config overrides that make ``cfg``'s mesh cover ``devices`` (tensor kept, fsdp takes
    the rest), each in backquotes (the command line says ``--set mesh.data=1 ...``).

    Example::

        >>> from lowrank_jax.train.config import load_config
        >>> suggest_mesh(load_config("tpu_v5e_256"), 8)
        '`mesh.data=1` `mesh.fsdp=2` `mesh.tensor=4`'
    """
    tensor = cfg.mesh.tensor if devices % cfg.mesh.tensor == 0 else 1
    return f"`mesh.data=1` `mesh.fsdp={devices // tensor}` `mesh.tensor={tensor}`"


def topology_mesh(cfg: RunConfig, topology: str):
    """The config's ``(data, fsdp, tensor)`` mesh over the compile-only devices of ``topology``.

    Raises ``ValueError`` (with overrides that fit) when the mesh does not cover exactly the
    topology's devices, and :class:`pallas_kernels.aot.TopologyError` without libtpu (TPU) or
    the CUDA plugin (GPU).
    """
    from pallas_kernels import aot

    if gpu_topology(topology) is not None:
        devices = gpu_devices(topology)
    else:
        # several processes (parallel tests, other compiles) may load libtpu to compile only
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        devices = aot.tpu_devices(topology)
    m = cfg.mesh
    if m.data * m.fsdp * m.tensor != len(devices):
        raise ValueError(
            f"mesh data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} = "
            f"{m.data * m.fsdp * m.tensor} devices, but topology {topology!r} has "
            f"{len(devices)}; lay the mesh over all of them, e.g. "
            f"{suggest_mesh(cfg, len(devices))}.")
    return shard_lib.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


@dataclasses.dataclass
class StepCompile:
    """What the compiler says one device of ``topology`` needs for one pretraining step.

    ``memory`` is :func:`pallas_kernels.aot.memory_report` (bytes per device); ``compiled_flops``
    XLA's count for one device (it includes rematerialised forwards), ``model_flops`` the
    analytic model FLOPs of one device's share of the step; ``plan`` the analytic memory plan.
    """

    config: str
    topology: str
    chip: str
    mesh: dict
    memory: dict
    compiled_flops: float | None
    model_flops: float
    plan: MemoryPlan
    batch_bytes: int
    seconds: float

    @property
    def planned_argument_bytes(self) -> float:
        """The plan's arguments: parameters + optimizer state (TPU layout) + the batch."""
        return self.plan.state_bytes_per_device + self.batch_bytes

    @property
    def devices(self) -> int:
        return self.plan.devices

    @property
    def hbm_bytes(self) -> int:
        return CHIPS[self.chip].hbm_bytes

    @property
    def total_bytes(self) -> int:
        """Peak bytes per device: arguments + outputs + temps + code, donated buffers once."""
        m = self.memory
        return (m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] + m["code_bytes"]
                - m["alias_bytes"])

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes

    def table(self) -> str:
        """The report ``lowrank-jax compile`` prints."""
        m, hbm = self.memory, self.hbm_bytes
        gib = lambda b: f"{b / GIB:8.3f} GiB"  # noqa: E731
        rows = [
            ("arguments (params, optimizer, batch)", gib(m["argument_bytes"]),
             f"plan {self.planned_argument_bytes / GIB:.3f} GiB"),
            ("outputs", gib(m["output_bytes"]), ""),
            ("temporaries (activations, gradients)", gib(m["temp_bytes"]),
             f"plan activations {self.plan.activation_bytes_per_device / GIB:.3f} GiB"
             + ("" if self.plan.remat else " (no remat)")),
            ("generated code", gib(m["code_bytes"]), ""),
            ("aliased (donated)", gib(m["alias_bytes"]), ""),
            ("total per device", gib(self.total_bytes),
             f"{100 * self.total_bytes / hbm:.1f}% of {CHIPS[self.chip].name}'s "
             f"{hbm / GIB:.4g} GiB HBM"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{self.config} on {self.topology}: {self.devices} x {CHIPS[self.chip].name}, "
                 f"mesh {self.mesh}, compiled in {self.seconds:.1f} s"]
        lines += [f"  {k:<{width}}  {v}  {note}".rstrip() for k, v, note in rows]
        compiled = ("n/a (no XLA cost analysis for this target)"
                    if self.compiled_flops is None else
                    f"{self.compiled_flops / 1e12:.2f} TFLOP (XLA cost analysis, with "
                    "recomputation)")
        lines.append(f"  FLOPs per device per step: compiled {compiled}, analytic "
                     f"{self.model_flops / 1e12:.2f} TFLOP (model FLOPs, 6N + attention)")
        lines.append("  fits" if self.fits else
                     f"  DOES NOT FIT: {self.total_bytes / GIB:.2f} GiB > {hbm / GIB:.4g} GiB")
        return "\n".join(lines)


@contextlib.contextmanager
def native_stderr(show: bool = False):
    """Keep what native code (libtpu's start-up warnings) writes to file descriptor 2 off the
    terminal; ``show`` leaves it there. Python's own ``sys.stderr`` is unaffected."""
    if show:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return None if flops is None else float(flops)


def _resource_line(err: Exception) -> str:
    text = str(err)
    for line in text.splitlines():
        if "RESOURCE_EXHAUSTED" in line or "Ran out of memory" in line:
            return re.sub(r"\s+", " ", line).strip()
    return re.sub(r"\s+", " ", text.splitlines()[0] if text else repr(err)).strip()


def compile_pretrain_step(cfg: RunConfig, topology: str, *,
                          config: str = "config") -> StepCompile:
    """Compile ``pretrain``'s step for ``cfg`` on the TPU ``topology``; nothing is allocated.

    Args:
        cfg: the run configuration; its mesh must cover the topology's devices.
        topology: a slice name (``"v5e-256"``) or a libtpu topology (``"v5e:2x4"``).
        config: the config's name, for the report.

    Returns:
        A :class:`StepCompile`. Raises :class:`DoesNotFit` with the compiler's line when XLA
        reports ``RESOURCE_EXHAUSTED``.
    """
    from lowrank_jax.train.loop import init_state, pretrain_step

    chip = topology_chip(topology)
    mesh = topology_mesh(cfg, topology)
    devices = mesh.devices.size
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.batch_size % split:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} is not divisible by data x "
                         f"fsdp = {split}; use a multiple of {split}.")
    started = time.perf_counter()
    state, tx = init_state(cfg, mesh, abstract=True)
    step, batch_spec = pretrain_step(state, tx, mesh)
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32,
                                 sharding=batch_spec)
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = step.lower(state.params, state.opt_state, batch, batch).compile()
    except Exception as err:  # XLA's out-of-memory is a plain XlaRuntimeError
        if "RESOURCE_EXHAUSTED" in str(err) or "Ran out of memory" in str(err):
            raise DoesNotFit(f"{config} does not fit {CHIPS[chip].name} "
                             f"({CHIPS[chip].hbm_bytes / GIB:.0f} GiB HBM): "
                             f"{_resource_line(err)}") from None
        raise
    seconds = time.perf_counter() - started
    from pallas_kernels.aot import memory_report, topology_name

    tokens = cfg.train.batch_size * cfg.train.seq_len
    model_flops = training_flops_per_token(cfg.model, cfg.train.seq_len) * tokens / devices
    gpu = gpu_topology(topology) is not None
    layout = None if gpu else "tpu"
    return StepCompile(
        config=config, topology=topology.lower() if gpu else topology_name(topology), chip=chip,
        mesh=dict(mesh.shape), memory=memory_report(compiled),
        compiled_flops=_cost_flops(compiled), model_flops=model_flops,
        plan=plan_memory(cfg, devices, layout=layout),
        batch_bytes=2 * device_bytes(batch_spec.shard_shape(batch.shape), batch.dtype, layout),
        seconds=seconds)


__all__ = ["DoesNotFit", "GPU_PROPERTIES", "StepCompile", "compile_pretrain_step", "gpu_devices",
           "gpu_target_config", "gpu_topology", "native_stderr", "suggest_mesh", "topology_chip",
           "topology_mesh"]
