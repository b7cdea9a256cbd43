"""Extension point (a) of the model core: what keys/values each decoder layer attends to.

:class:`KVProvider` is the protocol the one decoder loop
(:func:`lowrank_jax.models.llama.run_layers`) asks; :class:`CausalKV` (no cache) and the exact
:class:`KVCache` are the built-in providers; :mod:`lowrank_jax.kv` adds the compressed ones.
:mod:`lowrank_jax.models.llama` re-exports all four names.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from lowrank_jax.models.config import LlamaConfig


class KVProvider:
    """Extension point (a): what keys/values each decoder layer attends to.

    Pass a provider as ``cache=`` to :class:`Llama` (or to :func:`lowrank_jax.models.forward`);
    the one decoder loop (:func:`run_layers`) asks it, for every layer, to attend with the
    layer's queries, and returns ``provider.advance(updates, t)`` as the new cache. Built in:
    no cache (:class:`CausalKV`, plain causal attention), the exact :class:`KVCache`;
    :mod:`lowrank_jax.kv` adds the xKV-compressed ones, and sparse patterns such as SALE come in
    through the ``attention`` function the provider is handed (``LlamaConfig.attention``).

    A provider is a pytree (it crosses ``jax.jit``) with:

    - ``scannable``: ``True`` if :meth:`attend` does not depend on the (Python) layer index, so
      the layers may run under ``jax.lax.scan``; its :meth:`per_layer` data is then sliced
      along a leading layer axis and its updates are stacked along it.
    - :meth:`positions` ``(batch, length)``: the RoPE positions of the new tokens.
    - :meth:`per_layer`: a pytree with a leading ``n_layers`` axis (or ``None``); layer ``i``
      receives its slice as ``layer_data``.
    - :meth:`attend` ``(layer, layer_data, q, k, v, keys_pre_rope, attention)`` with ``q``, ``k``
      post-RoPE ``[b, t, heads, d]``: returns the attention output ``[b, t, heads, d]`` and the
      layer's update.
    - :meth:`advance` ``(updates, length)``: what the forward returns as the new cache
      (``updates`` stacked per layer when ``scannable``, else a list).
    """

    scannable = True

    def start(self):
        return 0

    def positions(self, batch: int, length: int):
        return jnp.broadcast_to(self.start() + jnp.arange(length)[None, :], (batch, length))

    def per_layer(self):
        return None

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        raise NotImplementedError

    def advance(self, updates, length):
        return self


@jax.tree_util.register_static
class CausalKV(KVProvider):
    """No cache: plain causal self-attention over the given tokens (returns ``None`` as cache)."""

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self).__name__)

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        return attention(q, k, v, causal=True), None

    def advance(self, updates, length):
        return None


class KVCache(NamedTuple):
    """Preallocated keys/values ``[layers, batch, max_len, kv_heads, head_dim]`` (post-RoPE).

    The exact :class:`KVProvider`: new keys/values are written at ``length`` and the queries
    attend to the filled prefix. A layer's update is only its new keys/values ``[b, t, hk, d]``;
    :meth:`advance` writes all layers' at once into the stacked buffers (in place when the cache
    is donated), so a decode step writes ``t`` positions, not the whole cache (DERIVED: stacking
    each layer's updated cache rewrote ``O(layers · max_len)`` bytes per token).
    """

    keys: Array
    values: Array
    length: Array  # shape=(), int32: how many positions are filled

    scannable = True

    @classmethod
    def empty(cls, cfg: LlamaConfig, batch: int, max_len: int | None = None, dtype=None):
        max_len = max_len or cfg.max_seq_len
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        dtype = dtype or jnp.dtype(cfg.dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    def start(self):
        return self.length

    positions = KVProvider.positions

    def per_layer(self):
        return (self.keys, self.values)

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        ck, cv = layer_data
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, self.length, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, self.length, 0, 0))
        out = attention(q, ck, cv, causal=True, q_offset=self.length,
                        kv_length=self.length + q.shape[1])
        return out, (k.astype(ck.dtype), v.astype(cv.dtype))

    def advance(self, updates, length):
        at = (0, 0, self.length, 0, 0)
        return KVCache(jax.lax.dynamic_update_slice(self.keys, updates[0], at),
                       jax.lax.dynamic_update_slice(self.values, updates[1], at),
                       self.length + length)


def as_provider(cache) -> KVProvider:
    """``None`` → :class:`CausalKV`; anything else must follow the :class:`KVProvider` protocol."""
    if cache is None:
        return CausalKV()
    for name in ("positions", "per_layer", "attend", "advance"):
        if not callable(getattr(cache, name, None)):
            raise ValueError(
                f"cache={type(cache).__name__} has no {name}(); pass None, a KVCache or an "
                "object following lowrank_jax.models.llama.KVProvider."
            )
    return cache


__all__ = ["CausalKV", "KVCache", "KVProvider", "as_provider"]
