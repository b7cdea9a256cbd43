"""The dispatcher's kernel entries: flash and SALE prefill, the reference for everything else.

Under a mesh, the kernels run inside ``jax.shard_map`` over batch and heads (Mosaic and Triton
kernels are not auto-partitioned): :func:`run_sharded`.

``pallas_kernels`` holds the kernels and never imports ``lowrank_jax``; this module adapts them to
the dispatcher signature ``fn(q, k, v, *, causal, q_offset, kv_length, scale)`` and registers them
(``"flash"`` and ``"sale"`` on first :func:`lowrank_jax.attention.get_attention`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.attention import reference_attention, register_attention
from pallas_kernels.flash_attention.api import flash_attention
from pallas_kernels.sparse_attention.api import DEFAULT_TAU, sale_prefill_attention


#: Mesh axes a kernel call is split over: the batch over data-parallel axes, heads over tensor.
_BATCH_AXES = ("data", "fsdp")
_HEAD_AXES = ("tensor",)


def kernel_partition(mesh, batch: int, heads: int, kv_heads: int):
    """``(batch_axes, head_axis, manual_axes)`` of a kernel call under ``mesh``.

    The batch is split over the ``_BATCH_AXES`` (in order) whose sizes still divide it, the
    heads over ``"tensor"`` when it divides both ``heads`` and ``kv_heads``; every other axis of
    size > 1 that is not already manual is manual too, with the inputs replicated over it (a
    Mosaic / Triton kernel is not auto-partitioned, so no axis may be left to XLA).

    Example::

        >>> from jax.sharding import AbstractMesh
        >>> mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
        >>> kernel_partition(mesh, batch=2, heads=9, kv_heads=3)
        (('data',), None, ('data', 'fsdp', 'tensor'))
    """
    manual = set(getattr(mesh, "manual_axes", ()))
    free = [a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1]
    batch_axes, size = [], 1
    for axis in _BATCH_AXES:
        if axis in free and batch % (size * mesh.shape[axis]) == 0:
            batch_axes.append(axis)
            size *= mesh.shape[axis]
    head_axis = None
    for axis in _HEAD_AXES:
        if axis in free and heads % mesh.shape[axis] == 0 and kv_heads % mesh.shape[axis] == 0:
            head_axis = axis
            break
    return tuple(batch_axes), head_axis, tuple(free)


def run_sharded(fn: Callable, q, k, v, *batch_args, head_args=()):
    """``fn(q, k, v, *batch_args, *head_args)``, inside ``jax.shard_map`` when a mesh is set.

    Under a mesh (``jax.set_mesh`` / ``jax.sharding.use_abstract_mesh``, concrete or abstract)
    the call runs per shard (:func:`kernel_partition`): ``q, k, v [b, t, heads, d]`` split on
    batch and heads, ``batch_args`` (segment ids ``[b, t]``) on batch, ``head_args``
    (per-head vectors ``[heads]``) on heads. Without a mesh (or with every axis of size 1 or
    already manual) it is a plain call.
    """
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(q, k, v, *batch_args, *head_args)
    batch_axes, head_axis, manual = kernel_partition(mesh, q.shape[0], q.shape[2], k.shape[2])
    if not manual:
        return fn(q, k, v, *batch_args, *head_args)
    batch = batch_axes or None
    qkv = P(batch, None, head_axis, None)
    in_specs = (qkv, qkv, qkv) + (P(batch, None),) * len(batch_args) + (
        P(head_axis),) * len(head_args)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=qkv,
                         axis_names=set(manual), check_vma=False)(q, k, v, *batch_args,
                                                                 *head_args)


def flash_dispatch(q, k, v, *, causal=True, q_offset=0, kv_length=None, scale=None,
                   window=None, logit_softcap=None, segment_ids=None):
    """The ``"flash"`` entry: the flash kernel for prefill, the reference for KV-cache decode.

    Sliding window, logit soft-cap and segment ids go to the kernel. Under a mesh the kernel
    runs inside ``jax.shard_map`` over batch and heads (:func:`run_sharded`).
    """
    prefill = (
        kv_length is None
        and isinstance(q_offset, int)
        and q_offset == 0
        and (not causal or q.shape[1] <= k.shape[1])
    )
    if not prefill:
        return reference_attention(q, k, v, causal=causal, q_offset=q_offset,
                                   kv_length=kv_length, scale=scale, window=window,
                                   logit_softcap=logit_softcap, segment_ids=segment_ids)

    def run(q, k, v, *segments):
        return flash_attention(q, k, v, causal=causal, scale=scale, window=window,
                               logit_softcap=logit_softcap,
                               segment_ids=tuple(segments) if segments else None)

    return run_sharded(run, q, k, v, *(segment_ids or ()))


def make_sale_attention(
    tau: Any = DEFAULT_TAU, cfg=None, *, implementation: str = "auto"
) -> Callable:
    """A dispatcher-signature function running SALE for causal prefill, reference otherwise.

    Example::

        >>> from lowrank_jax.attention import register_attention, unregister_attention
        >>> register_attention("sale_strict", make_sale_attention(tau=0.016))
        >>> unregister_attention("sale_strict")
    """

    def sale_attention(q, k, v, *, causal=True, q_offset=0, kv_length=None, scale=None,
                       **masks):
        prefill = (not any(value is not None for value in masks.values())
                   and causal and kv_length is None and isinstance(q_offset, int) and q_offset == 0
                   and q.shape[1] == k.shape[1])
        if not prefill:
            return reference_attention(q, k, v, causal=causal, q_offset=q_offset,
                                       kv_length=kv_length, scale=scale, **masks)
        tau_heads = jnp.asarray(tau, jnp.float32)
        if tau_heads.ndim == 0:
            tau_heads = jnp.broadcast_to(tau_heads, (q.shape[2],))
        if tau_heads.shape != (q.shape[2],):
            raise ValueError(f"sale: tau has shape {tau_heads.shape}; pass a scalar or one "
                             f"threshold per query head ({q.shape[2]},).")

        def run(q, k, v, tau_heads):
            return sale_prefill_attention(q, k, v, tau_heads, cfg, scale=scale,
                                          implementation=implementation)

        return run_sharded(run, q, k, v, head_args=(tau_heads,))

    return sale_attention


def register_sale_per_layer(
    taus: Any, cfg=None, *, implementation: str = "auto"
) -> tuple[str, ...]:
    """Register one SALE attention per layer; returns the names for ``LlamaConfig.attention``.

    Args:
        taus: ``[n_layers]`` or ``[n_layers, heads]`` thresholds, e.g. from
            :func:`pallas_kernels.sparse_attention.reference.calibrate_thresholds` per layer.
        cfg: the :class:`pallas_kernels.sparse_attention.SaleConfig` (default ``SaleConfig()``).
        implementation: ``"auto"``, ``"pallas"`` or ``"xla"`` (as ``sale_prefill_attention``).

    Returns:
        One registered name per layer. Names are derived from the thresholds, the config and
        the implementation, so registering the same settings twice gives the same names and
        different settings never overwrite each other.

    Example::

        >>> from lowrank_jax.models import LlamaConfig
        >>> names = register_sale_per_layer([0.004, 0.016])
        >>> cfg = LlamaConfig(n_layers=2, attention=names)
        >>> cfg.attention_for(1) == names[1] != names[0]
        True
    """
    taus = np.asarray(taus, np.float32)
    if taus.ndim not in (1, 2) or taus.shape[0] == 0:
        raise ValueError(f"taus has shape {taus.shape}; pass [n_layers] or [n_layers, heads].")
    if not np.all(np.isfinite(taus)) or np.any(taus < 0):
        raise ValueError("taus must be finite and >= 0 (0 = a dense head).")
    names = []
    for row in taus:
        digest = hashlib.sha1(row.tobytes() + repr((cfg, implementation)).encode()).hexdigest()
        name = f"sale/{digest[:12]}"
        tau = float(row) if row.ndim == 0 else row
        register_attention(name, make_sale_attention(tau, cfg, implementation=implementation))
        names.append(name)
    return tuple(names)


__all__ = ["flash_dispatch", "kernel_partition", "make_sale_attention",
           "register_sale_per_layer", "run_sharded"]
