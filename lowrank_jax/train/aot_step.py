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


def topology_chip(topology: str) -> str:
    """The :data:`~lowrank_jax.models.flops.CHIPS` key of a TPU topology name.

    Example::

        >>> topology_chip("v5e-256"), topology_chip("v5p:2x2x2"), topology_chip("v6e:4x4")
        ('v5e', 'v5p', 'v6e')
    """
    from pallas_kernels.aot import topology_name

    chip = topology_name(topology).split(":")[0]
    if chip not in CHIPS:
        raise ValueError(f"--topology {topology!r}: no chip {chip!r} in the chip table "
                         f"({', '.join(sorted(CHIPS))}).")
    return chip


def suggest_mesh(cfg: RunConfig, devices: int) -> str:
    """A ``--set`` that makes ``cfg``'s mesh cover ``devices`` (tensor kept, fsdp takes the rest).

    Example::

        >>> from lowrank_jax.train.config import load_config
        >>> suggest_mesh(load_config("tpu_v5e_256"), 8)
        '--set mesh.data=1 --set mesh.fsdp=2 --set mesh.tensor=4'
    """
    tensor = cfg.mesh.tensor if devices % cfg.mesh.tensor == 0 else 1
    return f"--set mesh.data=1 --set mesh.fsdp={devices // tensor} --set mesh.tensor={tensor}"


def topology_mesh(cfg: RunConfig, topology: str):
    """The config's ``(data, fsdp, tensor)`` mesh over the compile-only devices of ``topology``.

    Raises ``ValueError`` (with a ``--set`` that fits) when the mesh does not cover exactly the
    topology's devices, and :class:`pallas_kernels.aot.TopologyError` without libtpu.
    """
    from pallas_kernels import aot

    # several processes (parallel tests, other compiles) may load libtpu for compiling only
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
             f"{hbm / GIB:.0f} GiB HBM"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [f"{self.config} on {self.topology}: {self.devices} x {CHIPS[self.chip].name}, "
                 f"mesh {self.mesh}, compiled in {self.seconds:.1f} s"]
        lines += [f"  {k:<{width}}  {v}  {note}".rstrip() for k, v, note in rows]
        compiled = ("n/a" if self.compiled_flops is None
                    else f"{self.compiled_flops / 1e12:.2f} TFLOP")
        lines.append(f"  FLOPs per device per step: compiled {compiled} (XLA cost analysis, "
                     f"with recomputation), analytic {self.model_flops / 1e12:.2f} TFLOP "
                     "(model FLOPs, 6N + attention)")
        lines.append("  fits" if self.fits else
                     f"  DOES NOT FIT: {self.total_bytes / GIB:.2f} GiB > {hbm / GIB:.0f} GiB")
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
    return StepCompile(
        config=config, topology=topology_name(topology), chip=chip, mesh=dict(mesh.shape),
        memory=memory_report(compiled), compiled_flops=_cost_flops(compiled),
        model_flops=model_flops, plan=plan_memory(cfg, devices, layout="tpu"),
        batch_bytes=2 * device_bytes(batch_spec.shard_shape(batch.shape), batch.dtype, "tpu"),
        seconds=seconds)


__all__ = ["DoesNotFit", "StepCompile", "compile_pretrain_step", "native_stderr", "suggest_mesh",
           "topology_chip", "topology_mesh"]
