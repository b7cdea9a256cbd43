"""Packed rows through the one model core: a :class:`~lowrank_jax.models.llama.KVProvider` whose
attention stays inside each document.

A packed row holds several documents; ``segment_ids [batch, length]`` numbers them (0 is
padding). :class:`PackedKV` is extension point (a) of :class:`~lowrank_jax.models.llama.Llama`:
every layer attends causally *and* only to keys of the query's own segment
(``attention(q, k, v, causal=True, segment_ids=(seg, seg))``, honoured by the attention
reference and the kernels that take segment ids). With per-document ``positions`` (restarting
at 0) the logits of a packed row equal those of each document run alone::

    logits, _ = model(tokens, positions, cache=PackedKV(segment_ids))
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

from lowrank_jax.models.llama import KVProvider


class PackedKV(NamedTuple):
    """No cache; causal attention within the segments of packed rows (a pytree, scannable).

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2,
        ...                           n_kv_heads=2, d_ff=16), rngs=nnx.Rngs(0))
        >>> row = jnp.array([[3, 4, 5, 6, 7]])
        >>> seg, pos = jnp.array([[1, 1, 1, 2, 2]]), jnp.array([[0, 1, 2, 0, 1]])
        >>> packed, _ = model(row, pos, cache=PackedKV(seg))
        >>> alone, _ = model(row[:, 3:])
        >>> bool(jnp.allclose(packed[:, 3:], alone, atol=1e-5))
        True
    """

    segment_ids: Array  # [batch, length] int: the document of each token (0 = padding)

    scannable = True

    def start(self):
        return 0

    def positions(self, batch: int, length: int):
        """``0 .. length - 1`` (pass each document's own positions to the model instead)."""
        return KVProvider.positions(self, batch, length)

    def per_layer(self):
        return None

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        segments = jnp.asarray(self.segment_ids)
        return attention(q, k, v, causal=True, segment_ids=(segments, segments)), None

    def advance(self, updates, length):
        return None


__all__ = ["PackedKV"]
