"""Sharding placement: put an array where another one lives (Explicit meshes; no-ops off them).

One home for the helpers the optimizers use to keep ``jax.typeof`` of their states stable:
:func:`with_sharding_of` (reshard to ``like``'s sharding), :func:`gathered` (replicate a sharded
thin factor for QR / SVD), :func:`place_like` (also places concrete arrays, ``device_put``) and
:func:`replicate_like` (replicated over ``ref``'s mesh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def gathered(x):
    """``x`` replicated when it is sharded on an Explicit mesh (QR / SVD / solves need whole
    matrix dims); a no-op otherwise. Only for thin factors and small matrices."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is not None and any(axis is not None for axis in spec):
        return jax.sharding.reshard(x, PartitionSpec(*([None] * x.ndim)))
    return x


def with_sharding_of(out, like):
    """``out`` resharded to ``like``'s Explicit-mesh sharding (so optimizer states keep their
    ``jax.typeof``); a no-op without an Explicit mesh."""
    sharding = getattr(jax.typeof(like), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or all(s is None for s in sharding.spec):
        return out
    return jax.sharding.reshard(out, sharding)


def _mesh_spec(ref):
    """``ref``'s sharding when it lives on an Explicit mesh, else ``None``."""
    sharding = getattr(jax.typeof(ref), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if not any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return None
    return sharding


def _place(x, ref, spec):
    if isinstance(ref, jax.core.Tracer) or isinstance(x, jax.core.Tracer):
        mesh = jax.typeof(ref).sharding.mesh
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    concrete = getattr(ref, "sharding", None)
    if isinstance(concrete, NamedSharding):
        return jax.device_put(x, NamedSharding(concrete.mesh, spec))
    return x


def place_like(x, ref):
    """``x`` placed like ``ref`` on an Explicit mesh (so ``jax.typeof`` of the state is stable)."""
    sharding = _mesh_spec(ref)
    if sharding is None or jax.typeof(x).sharding == sharding:
        return x
    return _place(x, ref, sharding.spec)


def replicate_like(x, ref):
    """``x`` replicated over ``ref``'s Explicit mesh (no-op off a mesh)."""
    if _mesh_spec(ref) is None:
        return x
    return _place(x, ref, jax.sharding.PartitionSpec(*([None] * jnp.ndim(x))))


__all__ = ["gathered", "place_like", "replicate_like", "with_sharding_of"]
