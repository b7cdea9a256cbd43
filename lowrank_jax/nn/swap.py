"""What a module the library swaps in for a user's projection keeps: the replaced module's public
attributes (:class:`ReadsThrough`), its weights' dtype and sharding (:func:`assign_keeping_layout`)
and its logical axes (:func:`new_param`).

Example::

    >>> from flax import nnx
    >>> q = nnx.Einsum("BTD,DNH->BTNH", (8, 2, 4), rngs=nnx.Rngs(0))
    >>> dict(public_attributes(q))["kernel_shape"]
    (8, 2, 4)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def new_param(cls, value, out_sharding=None, like=None):
    """``cls(value)`` (an ``nnx.Param`` type) carrying the logical axis names ``out_sharding``,
    and the ``mesh`` / ``sharding_rules`` metadata of the variable ``like``; placed on its
    sharding now when a mesh is reachable (flax's eager sharding), else metadata only."""
    if not out_sharding or all(n is None for n in out_sharding):
        return cls(value)
    meta = {"out_sharding": tuple(out_sharding)}
    if like is not None:
        known = like.get_metadata()
        meta.update({k: known[k] for k in ("mesh", "sharding_rules") if known.get(k) is not None})
    try:
        return cls(value, **meta)
    except (ValueError, KeyError, TypeError, AssertionError, RuntimeError):
        return cls(value, eager_sharding=False, **meta)


def assign_keeping_layout(variable, value) -> None:
    """Write ``value`` into ``variable`` in the variable's dtype and, for a committed array, on
    its sharding (a merge never changes where or how a weight is stored)."""
    old = variable[...]
    value = jnp.asarray(value).astype(old.dtype)
    sharding = getattr(old, "sharding", None)
    if sharding is not None and not isinstance(old, jax.core.Tracer) \
            and not isinstance(value, jax.core.Tracer):
        value = jax.device_put(value, sharding)
    variable.set_value(value)


_SIMPLE = (str, int, float, bool, type(None), np.dtype, type)


def _plain(value) -> bool:
    """A value a swapped-in module can carry for its predecessor: a string, number, dtype, type
    or tuple of those (hashable, so it stays static in the NNX graph)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _SIMPLE)


def public_attributes(module) -> tuple[tuple[str, Any], ...]:
    """``((name, value), ...)`` of ``module``'s public plain attributes and properties (sizes,
    shapes, einsum strings, dtypes, flags): what a swapped-in module reads through to, captured
    when the module it replaces goes away (arrays, variables and sub-modules are left out)."""
    found = {}
    for name, value in vars(module).items():
        if not name.startswith("_") and _plain(value):
            found[name] = value
    for name in dir(type(module)):
        if name.startswith("_") or name in found:
            continue
        if isinstance(getattr(type(module), name, None), property):
            try:
                value = getattr(module, name)
            except Exception:  # a property that needs state the module no longer has
                continue
            if _plain(value):
                found[name] = value
    return tuple(sorted(found.items()))


class ReadsThrough:
    """Mixin of the modules the library swaps in for a user's projection (adapted, factorized,
    quantized): a public attribute the new module does not define reads through to the module
    it replaced — the live ``base`` when it keeps one (an adapter), else the plain attributes
    captured from it at swap time (``replaced_attributes``, see :func:`public_attributes`). So
    a user's forward that reads ``self.o_proj.shape[1]`` or ``self.q.einsum_str`` still runs.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from lowrank_jax.nn import factorize
        >>> class Block(nnx.Module):
        ...     def __init__(self):
        ...         self.o = nnx.Einsum("BTNH,NHD->BTD", (2, 4, 8), rngs=nnx.Rngs(0))
        >>> block = Block(); _ = factorize(block, "o", rank=4)
        >>> block.o.kernel_shape, block.o.einsum_str
        ((2, 4, 8), 'BTNH,NHD->BTD')
    """

    replaced_attributes: tuple = ()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        state = object.__getattribute__(self, "__dict__")
        base = state.get("base")
        if base is not None and name != "base" and hasattr(base, name):
            return getattr(base, name)
        for key, value in state.get("replaced_attributes", ()):
            if key == name:
                return value
        replaced = state.get("replaced_type")
        if base is not None:
            replaced = getattr(base, "replaced_type", None) or type(base).__name__
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
            + (f" (nor had the {replaced} it replaced)" if replaced else ""))


__all__ = ["ReadsThrough", "assign_keeping_layout", "new_param", "public_attributes"]
