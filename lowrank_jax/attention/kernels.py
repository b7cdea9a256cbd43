"""The dispatcher's kernel entries: flash and SALE prefill, the reference for everything else.

``pallas_kernels`` holds the kernels and never imports ``lowrank_jax``; this module adapts them to
the dispatcher signature ``fn(q, k, v, *, causal, q_offset, kv_length, scale)`` and registers them
(``"flash"`` and ``"sale"`` on first :func:`lowrank_jax.attention.get_attention`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from lowrank_jax.attention import reference_attention, register_attention
from pallas_kernels.flash_attention.api import flash_attention
from pallas_kernels.sparse_attention.api import DEFAULT_TAU, sale_prefill_attention


def flash_dispatch(q, k, v, *, causal=True, q_offset=0, kv_length=None, scale=None, **masks):
    """The ``"flash"`` entry: the flash kernel for prefill, the reference for KV-cache decode.

    ``masks`` are the reference's optional ``window`` / ``logit_softcap`` / ``segment_ids``;
    until the kernel takes them, a call that sets one runs the reference.
    """
    plain_prefill = (
        not any(value is not None for value in masks.values())
        and kv_length is None
        and isinstance(q_offset, int)
        and q_offset == 0
        and (not causal or q.shape[1] <= k.shape[1])
    )
    if not plain_prefill:
        return reference_attention(q, k, v, causal=causal, q_offset=q_offset,
                                   kv_length=kv_length, scale=scale, **masks)
    return flash_attention(q, k, v, causal=causal, scale=scale)


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
        return sale_prefill_attention(q, k, v, tau, cfg, scale=scale,
                                      implementation=implementation)

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


__all__ = ["flash_dispatch", "make_sale_attention", "register_sale_per_layer"]
