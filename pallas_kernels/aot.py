"""Ahead-of-time proof on the hardware, from a CPU host: compile for TPU, lower for GPU.

One home for the two routes of ``specs/pallas_notes.md`` §5, shared by the kernels' compile tier
(``tests/pallas_kernels/test_compile_tier.py``) and the pod compile (``lowrank-jax compile``):

* **TPU, compiled by libtpu.** With ``libtpu`` installed (``pip install -e ".[tpu]"``: the version
  ``jax[tpu]`` pairs with the installed jax), :func:`tpu_devices` gives the compile-only devices
  of a named topology (``"v5e:2x2"``, ``"v5e-256"``, ``"v5p:2x2x2"``, ``"v6e:4x4"``…) and
  :func:`compile_for_tpu` runs Mosaic and XLA's TPU compiler on them; the compiled module's
  ``memory_analysis()`` is the real per-device memory.
* **GPU, lowered by jax.export.** :func:`export_for_gpu` lowers for ``cuda`` under an abstract mesh
  naming the device (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA H200"``): Triton's and Mosaic GPU's
  lowering rules run; the PTX compile needs the device.

:func:`kernel_calls` counts the Pallas kernels in a lowered or compiled module, so a test can fail
when an op silently fell back to XLA.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

#: Topology aliases: slice names as the clouds sell them -> libtpu topology names.
TOPOLOGY_ALIASES = {
    "v5e-4": "v5e:2x2", "v5e-8": "v5e:2x4", "v5e-16": "v5e:4x4", "v5e-32": "v5e:4x8",
    "v5e-64": "v5e:8x8", "v5e-128": "v5e:8x16", "v5e-256": "v5e:16x16",
    "v5p-8": "v5p:2x2x1", "v5p-16": "v5p:2x2x2", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4",
    "v5p-128": "v5p:4x4x4", "v5p-256": "v5p:4x4x8",
    "v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4", "v6e-64": "v6e:8x8",
    "v6e-256": "v6e:16x16",
}

#: GPU device kinds as ``jax.devices()[0].device_kind`` spells them.
GPU_KINDS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}

#: Custom-call targets of Pallas kernels in lowered / compiled modules, per backend.
KERNEL_TARGETS = {
    "tpu": ("tpu_custom_call",),
    "triton": ("__gpu$xla.gpu.triton",),
    "mosaic_gpu": ("mosaic_gpu", "__gpu$xla.gpu.ext.mosaic_gpu"),
}


class TopologyError(RuntimeError):
    """The TPU compile route is not available here (no libtpu) or the topology is unknown."""


def topology_name(name: str) -> str:
    """``"v5e-256"`` -> ``"v5e:16x16"``; a libtpu name (``"v5e:2x2"``) passes through.

    Example::

        >>> topology_name("v5e-8"), topology_name("v6e:2x2")
        ('v5e:2x4', 'v6e:2x2')
    """
    key = name.strip().lower()
    if key in TOPOLOGY_ALIASES:
        return TOPOLOGY_ALIASES[key]
    if re.fullmatch(r"v(5e|5p|6e|4):\d+x\d+(x\d+)?", key):
        return key
    raise TopologyError(
        f"unknown TPU topology {name!r}: use a slice name ({', '.join(sorted(TOPOLOGY_ALIASES))}) "
        "or a libtpu topology such as 'v5e:2x2' / 'v5p:2x2x2'.")


def has_libtpu() -> bool:
    """Whether libtpu is installed (the TPU compiler the compile-only route needs)."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def tpu_devices(name: str = "v5e:2x2") -> list:
    """The compile-only TPU devices of topology ``name`` on this (CPU) host.

    Raises :class:`TopologyError` saying how to install libtpu when it is missing.
    """
    if not has_libtpu():
        raise TopologyError(
            "compiling for TPU needs libtpu, the TPU compiler, which runs on a CPU host too: "
            'pip install -e ".[tpu]" (installs the libtpu that jax[tpu] pairs with your jax).')
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes a host-wide lockfile (libtpu_lockfile in the temp folder) meant for a real
    # TPU; compile-only devices touch no chip, so two processes (pytest-xdist workers, a script
    # next to the tests) may both compile: without this the second fails "Internal error when
    # accessing libtpu multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topo = topology_name(name)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=topo, chip_config_name="default",
            chips_per_host_bounds=(2, 2, 1), num_slices=1)
    except Exception as err:  # libtpu's own message names what it did not accept
        raise TopologyError(f"libtpu refused topology {topo!r}: {err}") from err
    return list(desc.devices)


def tpu_mesh(name: str, axes: dict[str, int] | Sequence[tuple[str, int]] | None = None):
    """A ``jax.sharding.Mesh`` over the compile-only devices of ``name``.

    ``axes`` maps axis names to sizes whose product is the device count (default: one axis
    ``"x"`` over all devices). Example: ``tpu_mesh("v5e-8", {"data": 2, "fsdp": 2, "tensor": 2})``.
    """
    devices = tpu_devices(name)
    items = list((axes or {"x": len(devices)}).items() if isinstance(axes, dict) or axes is None
                 else axes)
    sizes = tuple(size for _, size in items)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"tpu_mesh: axes {dict(items)} multiply to {int(np.prod(sizes))}, but "
                         f"topology {name!r} has {len(devices)} devices.")
    return jax.sharding.Mesh(np.array(devices).reshape(sizes), tuple(n for n, _ in items))


def compile_for_tpu(fn: Callable, *args, topology: str = "v5e:2x2", mesh=None,
                    in_shardings: Any = None, out_shardings: Any = None, **jit_kwargs):
    """``jax.jit(fn).lower(*args).compile()`` for a TPU topology, on any host.

    ``args`` are ``jax.ShapeDtypeStruct``s (or arrays). Without ``mesh`` the function is compiled
    for one device of ``topology``. Pallas reads the TPU generation from the current mesh, so the
    compile runs under ``mesh``'s abstract mesh. Returns the ``jax.stages.Compiled``: its
    ``as_text()`` is the optimized module, ``memory_analysis()`` the per-device bytes.
    """
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(tpu_devices(topology)[:1]), ("x",))
    if in_shardings is None:
        in_shardings = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if out_shardings is not None:
        jit_kwargs["out_shardings"] = out_shardings
    jitted = jax.jit(fn, in_shardings=in_shardings, **jit_kwargs)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jitted.lower(*args).compile()


def export_for_gpu(fn: Callable, *args, device: str = "h200"):
    """``jax.export`` of ``jax.jit(fn)(*args)`` for ``cuda`` with the device named ``device``.

    ``device`` is ``"h100"``, ``"h200"`` or a full ``device_kind``. Runs every Pallas GPU
    lowering rule (Triton and Mosaic GPU) on this host; returns the ``jax.export.Exported``
    (``mlir_module()`` holds the kernels) or raises the lowering error.
    """
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    kind = GPU_KINDS.get(device.lower(), device)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=None, platform="cuda"))
    disabled = [export.DisabledSafetyCheck.custom_call(target)
                for target in KERNEL_TARGETS["triton"] + KERNEL_TARGETS["mosaic_gpu"]]
    with use_abstract_mesh(mesh):
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*args)


def module_text(compiled_or_exported) -> str:
    """The text of a compiled (``as_text``) or exported (``mlir_module``) module."""
    if hasattr(compiled_or_exported, "mlir_module"):
        return compiled_or_exported.mlir_module()
    return compiled_or_exported.as_text()


def kernel_calls(compiled_or_exported, backend: str) -> int:
    """How many Pallas kernel calls of ``backend`` (``"tpu"``, ``"triton"``, ``"mosaic_gpu"``)
    the module holds: 0 means the op fell back to XLA."""
    text = module_text(compiled_or_exported)
    return sum(text.count(target) for target in KERNEL_TARGETS[backend])


def memory_report(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled module: arguments, outputs, temps, aliases and code."""
    stats = compiled.memory_analysis()
    return {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "code_bytes": int(stats.generated_code_size_in_bytes),
    }


#: One compile-only device of each TPU generation the compile tier proves kernels on.
TPU_TARGETS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@dataclasses.dataclass(frozen=True)
class CompileCase:
    """One public entry point of an op, at one shape, to prove on the hardware.

    Each op's ``pallas_kernels/<op>/cases.py`` lists its cases (``compile_cases(size)``, size
    ``"production"`` for an 8B-class layer or ``"small"`` for odd small shapes); the compile tier
    and ``scripts/gpu/compile_matrix.py`` run every case on every target.

    Attributes:
      op: the op's package name (``"flash_attention"``).
      entry: the entry point (``"forward"``, ``"backward"``, ``"shrink"``…).
      fn: calls the op's public function with its defaults (``implementation="auto"``): on a
        TPU/GPU target that must run the Pallas kernel, never a silent XLA fallback.
      args: the inputs as ``jax.ShapeDtypeStruct``.
      gpu_backend: the Pallas GPU backend the op chose (``"triton"`` or ``"mosaic_gpu"``).
      targets: where the case must compile (``TPU_TARGETS`` keys, ``"h100"``, ``"h200"``).
    """

    op: str
    entry: str
    fn: Callable
    args: tuple
    gpu_backend: str = "triton"
    targets: tuple[str, ...] = ("v5e", "v5p", "v6e", "h100", "h200")

    @property
    def name(self) -> str:
        shapes = ", ".join("x".join(map(str, a.shape)) for a in self.args)
        return f"{self.op}.{self.entry}[{shapes}]"


def check_case(case: CompileCase, target: str) -> dict[str, Any]:
    """Compile (TPU) or lower (GPU) ``case`` for ``target`` and prove a kernel is in the module.

    Returns ``{"kernels": n, **memory_report}`` (memory only for TPU, where the module is
    compiled). Raises the compiler's error, or ``AssertionError`` when no Pallas kernel is in the
    module (the op fell back to XLA).
    """
    if target in TPU_TARGETS:
        compiled = compile_for_tpu(case.fn, *case.args, topology=TPU_TARGETS[target])
        found, backend, extra = kernel_calls(compiled, "tpu"), "tpu", memory_report(compiled)
    elif target in GPU_KINDS:
        exported = export_for_gpu(case.fn, *case.args, device=target)
        found, backend, extra = kernel_calls(exported, case.gpu_backend), case.gpu_backend, {}
    else:
        raise ValueError(f"check_case: target {target!r} is not one of "
                         f"{sorted(TPU_TARGETS) + sorted(GPU_KINDS)}.")
    if not found:
        raise AssertionError(f"{case.name} on {target}: no {backend} Pallas kernel in the "
                             "compiled module (the op fell back to XLA).")
    return {"kernels": found, **extra}


__all__ = ["CompileCase", "GPU_KINDS", "KERNEL_TARGETS", "TOPOLOGY_ALIASES", "TPU_TARGETS",
           "TopologyError", "check_case", "compile_for_tpu", "export_for_gpu", "has_libtpu",
           "kernel_calls", "memory_report", "module_text", "topology_name", "tpu_devices",
           "tpu_mesh"]
