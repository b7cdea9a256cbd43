"""Kernels under a mesh: run a Pallas kernel per shard of its row (token / batch) axis.

Mosaic and Triton kernels are not partitioned by XLA: called on a sharded array, the kernel's
custom call is replicated and its inputs all-gathered. The ops whose rows are independent
(grouped LoRA, the lattice matmul) therefore run their kernel inside ``jax.shard_map`` over the
mesh axes that shard the rows. Which axes: those named by the op's ``row_axes=`` argument, or by
default the batch axes of the current mesh (:data:`BATCH_AXES`, the names
``lowrank_jax.train.sharding`` gives them) that have more than one device. The mesh is the one set
by ``jax.set_mesh`` (or ``use_abstract_mesh`` when compiling for a
TPU topology, see :mod:`pallas_kernels.aot`); without one, nothing is sharded.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax

#: Mesh axes that shard the batch / token axis by default (``lowrank_jax.train.sharding.AXES``).
BATCH_AXES = ("data", "fsdp")
#: The mesh axis that shards features (heads, output features) in ``lowrank_jax.train.sharding``.
TENSOR_AXES = ("tensor",)


def row_axes(op: str, requested: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The axes of the current mesh to shard an op's rows over (``()``: no sharding).

    ``requested=None`` takes the :data:`BATCH_AXES` the mesh has with size > 1; an explicit name
    or tuple must exist in the mesh (``()`` turns sharding off). Axes that are already manual
    (the op is called inside a ``shard_map`` over them) are skipped.

    Example::

        >>> row_axes("op")  # no mesh set
        ()
    """
    mesh = jax.sharding.get_abstract_mesh()
    if requested is not None:
        names = (requested,) if isinstance(requested, str) else tuple(requested)
        if names and mesh.empty:
            raise ValueError(f"{op}: row_axes={names} names mesh axes but no mesh is set; call "
                             "it under jax.set_mesh(mesh) or pass row_axes=None.")
        missing = [a for a in names if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"{op}: row_axes {missing} are not axes of the current mesh "
                             f"{tuple(mesh.axis_names)}.")
    else:
        names = BATCH_AXES
    return present_axes(names)


def present_axes(names: Sequence[str]) -> tuple[str, ...]:
    """The axes among ``names`` that the current mesh has, with size > 1 and not yet manual.

    Example::

        >>> present_axes(TENSOR_AXES)  # no mesh set
        ()
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in names
                 if a in mesh.axis_names and a not in manual and mesh.shape[a] > 1)


def axes_size(axes: tuple[str, ...]) -> int:
    """Number of shards the current mesh splits into over ``axes``."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in axes)


def pad_rows(x, shards: int):
    """``x`` with its first axis zero-padded to a multiple of ``shards`` (every shard gets the
    same number of rows; the caller slices the padding off the result)."""
    pad = -x.shape[0] % shards
    return x if not pad else jax.numpy.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))


def unpad_rows(x, rows: int):
    """The first ``rows`` rows of a result of :func:`shard_map` over padded rows (with
    ``Explicit`` mesh axes an uneven slice of a sharded axis is undefined: the result is first
    resharded, gathered, which only happens when the rows did not split evenly)."""
    if x.shape[0] == rows:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
        x = jax.reshard(x, jax.sharding.PartitionSpec())
    return x[:rows]


def shard_index(axes: tuple[str, ...]):
    """This shard's linear index over ``axes`` (inside ``shard_map``)."""
    index = 0
    mesh = jax.sharding.get_abstract_mesh()
    for axis in axes:
        index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
    return index


def shard_map(fn, args, in_specs, out_specs):
    """``jax.shard_map(fn)(*args)`` over the current mesh; inputs of a mesh with ``Explicit``
    axes are first resharded to ``in_specs`` (``shard_map`` reshards ``Auto`` ones itself).

    ``check_vma=False``: a ``pallas_call``'s outputs carry no varying-axes type. The cotangent
    of an input replicated over the row axes (a weight) is still summed over the shards by
    ``shard_map``'s transpose.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
        args = [jax.reshard(x, spec) for x, spec in zip(args, in_specs)]
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         check_vma=False)(*args)


__all__ = ["BATCH_AXES", "TENSOR_AXES", "axes_size", "present_axes", "row_axes",
           "pad_rows", "shard_index", "shard_map", "unpad_rows"]
