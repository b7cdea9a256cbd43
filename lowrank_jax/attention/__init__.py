"""The attention dispatcher: one signature, several implementations.

Every implementation takes ``q [batch, q_len, heads, head_dim]`` and ``k, v [batch, kv_len,
kv_heads, head_dim]`` (grouped-query attention when ``kv_heads < heads``) and returns
``[batch, q_len, heads, head_dim]``. Query ``i`` sits at absolute position ``q_offset + i``; with
``causal=True`` it sees keys ``j <= q_offset + i``, and only keys ``j < kv_length`` are valid (the
rest of a preallocated KV cache is ignored). Three optional keywords are passed only when set, so
an implementation that does not take them keeps working on models that do not use them:
``window`` (sliding-window layers), ``logit_softcap`` (Gemma 2) and ``segment_ids`` (packed rows);
see :func:`~pallas_kernels.flash_attention.reference.attention_reference` for their meaning.

``"reference"`` is the one attention reference,
:func:`pallas_kernels.flash_attention.reference.attention_reference`. The kernels
(``pallas_kernels``) never import this package: the dispatcher registers them, ``"flash"`` and
``"sale"`` on first use (see :mod:`lowrank_jax.attention.kernels`), and users add their own with
:func:`register_attention`.
"""

from __future__ import annotations

from collections.abc import Callable

from pallas_kernels.flash_attention.reference import attention_mask
from pallas_kernels.flash_attention.reference import attention_reference as reference_attention

_IMPLEMENTATIONS: dict[str, Callable] = {}


def _lazy_flash() -> Callable:
    from lowrank_jax.attention.kernels import flash_dispatch

    return flash_dispatch


def _lazy_sale() -> Callable:
    from lowrank_jax.attention.kernels import make_sale_attention

    return make_sale_attention()


_LAZY: dict[str, Callable[[], Callable]] = {"flash": _lazy_flash, "sale": _lazy_sale}


def register_attention(name: str, fn: Callable) -> None:
    """Make ``fn`` selectable as ``attention=name`` in model configs."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_attention: name={name!r} must be a non-empty string.")
    if not callable(fn):
        raise ValueError(f"register_attention: fn for {name!r} must be callable, got {fn!r}.")
    _IMPLEMENTATIONS[name] = fn


def unregister_attention(name: str) -> None:
    """Remove a registered implementation (``"reference"`` cannot be removed).

    Example::

        >>> register_attention("mine", reference_attention)
        >>> unregister_attention("mine")
        >>> "mine" in available()
        False
    """
    if name == "reference":
        raise ValueError("unregister_attention: 'reference' is the ground truth and stays.")
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unregister_attention: {name!r} is not registered; see available().")
    del _IMPLEMENTATIONS[name]


def available() -> list[str]:
    """Names accepted by :func:`get_attention` (registered ones and the lazily loaded kernels)."""
    return sorted(set(_IMPLEMENTATIONS) | set(_LAZY))


register_attention("reference", reference_attention)


def get_attention(name: str) -> Callable:
    """The implementation registered under ``name`` (registering a kernel on first use)."""
    if name not in _IMPLEMENTATIONS and name in _LAZY:
        register_attention(name, _LAZY[name]())
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"Unknown attention implementation {name!r}; choose from {available()}.")
    return _IMPLEMENTATIONS[name]


def __getattr__(name: str):
    # The kernel wrappers import pallas (slow); load them only when asked for.
    if name in ("flash_dispatch", "make_sale_attention", "register_sale_per_layer"):
        from lowrank_jax.attention import kernels

        return getattr(kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["attention_mask", "available", "flash_dispatch", "get_attention",
           "make_sale_attention", "reference_attention", "register_attention",
           "register_sale_per_layer", "unregister_attention"]
