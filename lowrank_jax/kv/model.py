"""xKV through the model core: K/V providers for the one Llama forward (compressed decode,
teacher-forced blocks after a rebuilt context), prefill, generation, perplexity, CLI factory."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.kv.cache import SelectiveConfig, XKVCache
from lowrank_jax.kv.compress import xkv_compress
from lowrank_jax.kv.ranks import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SINK_TOKENS,
    DEFAULT_VALUE_RANK_SCALE,
)
from lowrank_jax.kv.selective import selective_decode_attention
from lowrank_jax.models.llama import KVProvider
from pallas_kernels.xkv_decode.api import xkv_decode_attention
from pallas_kernels.xkv_decode.reference import rope


def _resolve_sink(sink_tokens: int | None, selective) -> int:
    """``None`` means :data:`DEFAULT_SINK_TOKENS`, or 0 with selective reconstruction."""
    if sink_tokens is None:
        return 0 if selective is not None else DEFAULT_SINK_TOKENS
    return sink_tokens


@jax.tree_util.register_static
class PrefillKV(KVProvider):
    """Exact causal attention that also hands back every layer's pre-RoPE K and V.

    ``model(tokens, cache=PrefillKV())`` returns ``(logits, (keys, values))`` with
    ``keys, values [layers, b, t, kv_heads, head_dim]``: what :func:`xkv_compress` factorizes.
    """

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self).__name__)

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        return attention(q, k, v, causal=True), (keys_pre_rope, v)

    def advance(self, updates, length):
        return updates


@jax.tree_util.register_static
class AttentionInputsKV(KVProvider):
    """Exact causal attention (the model's own implementation) that hands back every layer's
    post-RoPE ``(q, k, v)``: the inputs an attention method (sparse, low-rank) would see.

    ``model(tokens, cache=AttentionInputsKV())`` returns ``(logits, (q, k, v))`` with
    ``q [layers, b, t, heads, head_dim]`` and ``k, v [layers, b, t, kv_heads, head_dim]``; see
    :func:`attention_inputs`.
    """

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self).__name__)

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        return attention(q, k, v, causal=True), (q, k, v)

    def advance(self, updates, length):
        return updates


@nnx.jit
def _attention_inputs(model, tokens):
    return model.hidden_states(tokens, cache=AttentionInputsKV())[1]


def attention_inputs(model, tokens: Int[Array, "b t"]):
    """Post-RoPE ``(q, k, v)`` of every layer for ``tokens`` (one jitted exact forward).

    Returns:
        ``q [layers, b, t, heads, head_dim]``, ``k, v [layers, b, t, kv_heads, head_dim]``.

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
        ...                   d_ff=16)
        >>> q, k, v = attention_inputs(Llama(cfg, rngs=nnx.Rngs(0)), jnp.zeros((1, 5), jnp.int32))
        >>> q.shape, k.shape
        ((2, 1, 5, 2, 4), (2, 1, 5, 1, 4))
    """
    return _attention_inputs(model, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["keys", "values"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ContextKV(KVProvider):
    """A teacher-forced block after a context given as dense post-RoPE K/V per layer.

    ``keys, values [layers, b, C, kv_heads, head_dim]``; the new tokens sit at positions
    ``C..C+t-1`` and query ``i`` sees the whole context plus the exact new keys ``<= i``. The
    forward returns ``None`` as cache.
    """

    keys: Array
    values: Array

    def start(self):
        return self.keys.shape[2]

    def per_layer(self):
        return (self.keys, self.values)

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        ctx_k, ctx_v = layer_data
        keys = jnp.concatenate([ctx_k.astype(k.dtype), k], axis=1)
        vals = jnp.concatenate([ctx_v.astype(v.dtype), v], axis=1)
        return attention(q, keys, vals, causal=True, q_offset=ctx_k.shape[1]), None

    def advance(self, updates, length):
        return None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["cache"],
                   meta_fields=["implementation"])
@dataclasses.dataclass(frozen=True)
class XKVDecodeKV(KVProvider):
    """One decode step against an :class:`XKVCache`: the compressed prompt plus the exact tail.

    RoPE frame shifted by the ``S`` exact sink tokens: factor row ``j`` (prompt token ``S + j``)
    sits at ``j``, which is where the decode kernel rotates it; queries, the tail and the sinks
    are rotated at (true position − S). Scores only depend on position differences, so this is
    exact attention over ``[sinks | rebuilt prompt | tail]``. The new token's key/value is
    appended to the tail before attention, so the token sees itself. Not scannable: each layer
    reads its own group's factors.
    """

    cache: XKVCache
    implementation: str = "auto"

    scannable = False

    def start(self):
        return self.cache.prefill_length - self.cache.sink_tokens + self.cache.tail_length

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        cache, step, shift = self.cache, self.cache.tail_length, self.cache.sink_tokens
        tk = jax.lax.dynamic_update_slice(cache.tail_keys[layer],
                                          k.astype(cache.tail_keys.dtype), (0, step, 0, 0))
        tv = jax.lax.dynamic_update_slice(cache.tail_values[layer],
                                          v.astype(cache.tail_values.dtype), (0, step, 0, 0))
        if cache.selective is not None:
            out = selective_decode_attention(q[:, 0], cache, layer, tail_keys=tk,
                                             tail_values=tv, tail_length=step + 1)
            return out[:, None], (tk, tv)
        exact_k, exact_v, exact_n = tk, tv, step + 1
        if shift:
            sink_k = rope(cache.sink_keys[layer], jnp.arange(shift) - shift, cache.rope_theta)
            sink_v = cache.sink_values[layer].astype(jnp.float32)
            exact_k = jnp.concatenate([sink_k.astype(tk.dtype), tk], axis=1)
            exact_v = jnp.concatenate([sink_v.astype(tv.dtype), tv], axis=1)
            exact_n = exact_n + shift
        g = cache.group_of(layer)
        out = xkv_decode_attention(
            q[:, 0], cache.key_factors[g], cache.key_bases[layer], cache.value_factors[g],
            cache.value_bases[layer], rope_theta=cache.rope_theta, tail_keys=exact_k,
            tail_values=exact_v, tail_length=exact_n, implementation=self.implementation,
        )
        return out[:, None], (tk, tv)

    def advance(self, updates, length):
        return dataclasses.replace(
            self.cache, tail_keys=jnp.stack([u[0] for u in updates]),
            tail_values=jnp.stack([u[1] for u in updates]),
            tail_length=self.cache.tail_length + length)


@nnx.jit
def _prefill_kv(model, tokens):
    _, (keys, values) = model.hidden_states(tokens, cache=PrefillKV())
    return keys, values


def prefill_kv(model, tokens: Int[Array, "b t"]):
    """Exact prefill of ``tokens``: pre-RoPE ``(keys, values)``, each
    ``[layers, b, t, kv_heads, head_dim]`` (jitted; what :func:`xkv_compress` takes).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> prefill_kv(model, jnp.zeros((1, 5), jnp.int32))[0].shape
        (2, 1, 5, 1, 8)
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [batch, length].")
    blockers = getattr(getattr(model, "cfg", None), "kv_compression_blockers", lambda: [])()
    if blockers:  # the compressed caches re-rotate keys with plain RoPE, attend unwindowed
        raise ValueError(
            f"KV-cache compression is not implemented for a {model.cfg.family} model with "
            f"{', '.join(blockers)}; use the exact cache (no `kv`).")
    return _prefill_kv(model, tokens)


def xkv_prefill(
    model,
    tokens: Int[Array, "b L"],
    *,
    ratio: float | None = 8.0,
    group_size: int = DEFAULT_GROUP_SIZE,
    rank: int | tuple[int, int] | None = None,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    selective: SelectiveConfig | None = None,
    max_new_tokens: int = 256,
    sink_tokens: int | None = None,
) -> XKVCache:
    """Run the exact prefill of ``tokens`` through ``model`` and compress its KV cache.

    Args:
        model: a :class:`lowrank_jax.models.llama.Llama`.
        tokens: prompt ``[b, L]``.
        ratio: target compression ratio (ignored when ``rank`` is given).
        group_size: layers per SVD group (1 = per-layer SVD).
        rank: explicit ``rank`` / ``(rank_k, rank_v)`` per group.
        value_rank_scale: ``r_v / r_k`` for ratio-chosen ranks.
        selective: enable selective reconstruction at decode.
        max_new_tokens: exact tail capacity for :func:`xkv_decode_step`.
        sink_tokens: leading prompt tokens kept exact (default :data:`DEFAULT_SINK_TOKENS`,
            or 0 with ``selective``; 0 is the paper's xKV).

    Returns:
        An :class:`XKVCache` (the prompt's own logits are not returned: feed the last prompt
        token through :func:`xkv_decode_step`, as :func:`xkv_generate` does).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> cache = xkv_prefill(model, jnp.zeros((1, 12), jnp.int32), rank=4, group_size=2)
        >>> logits, cache = xkv_decode_step(model, cache, jnp.zeros((1,), jnp.int32))
        >>> logits.shape
        (1, 32)
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens has shape {tokens.shape}; expected [batch, length].")
    keys, values = prefill_kv(model, tokens)
    return xkv_compress(
        keys, values, rope_theta=model.cfg.rope_theta, ratio=None if rank is not None else ratio,
        rank=rank, group_size=group_size, value_rank_scale=value_rank_scale,
        selective=selective, tail_capacity=max_new_tokens,
        sink_tokens=_resolve_sink(sink_tokens, selective),
    )


@functools.partial(nnx.jit, static_argnames=("implementation",))
def _decode_step(model, cache: XKVCache, token, implementation: str):
    logits, cache = model(token[:, None], cache=XKVDecodeKV(cache, implementation))
    return logits[:, 0], cache


def xkv_decode_step(
    model, cache: XKVCache, token: Int[Array, " b"], *, implementation: str = "auto"
) -> tuple[Float[Array, "b vocab"], XKVCache]:
    """Feed one token per sequence; attend to the compressed prompt and the exact tail.

    The new token's key/value is appended (exact, post-RoPE) to the tail before attention, so
    the token sees itself, as in the uncompressed model.

    Args:
        model: the :class:`~lowrank_jax.models.llama.Llama` that produced ``cache``.
        cache: from :func:`xkv_prefill`.
        token: ``[b]`` token ids (``[b, 1]`` is accepted too).
        implementation: decode-attention kernel choice (``"auto"``, ``"pallas"``, ``"xla"``).

    Returns:
        ``(logits [b, vocab] fp32, the advanced cache)``.
    """
    token = jnp.asarray(token)
    if token.ndim == 2 and token.shape[1] == 1:
        token = token[:, 0]
    if token.ndim != 1 or token.shape[0] != cache.tail_keys.shape[1]:
        raise ValueError(
            f"token has shape {token.shape}; expected [{cache.tail_keys.shape[1]}] (one id per "
            "sequence of the cache's batch)."
        )
    if int(cache.tail_length) >= cache.tail_keys.shape[2]:
        raise ValueError(
            f"the cache's exact tail is full ({cache.tail_keys.shape[2]} tokens); prefill with a "
            "larger max_new_tokens."
        )
    return _decode_step(model, cache, token, implementation)


def xkv_generate(
    model, prompt: Int[Array, "b P"], *, max_new_tokens: int, ratio: float | None = 8.0,
    group_size: int = DEFAULT_GROUP_SIZE, rank=None,
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    selective: SelectiveConfig | None = None, implementation: str = "auto",
    sink_tokens: int | None = None,
) -> Int[Array, "b n"]:
    """Greedy generation with a compressed prompt cache.

    The prompt minus its last token is prefilled and compressed; the last prompt token and every
    generated token then go through :func:`xkv_decode_step`, so each new token is predicted from
    the compressed prompt plus the exact tail.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> xkv_generate(model, jnp.zeros((1, 12), jnp.int32), max_new_tokens=3,
        ...              rank=4, group_size=2).shape
        (1, 3)
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 2:
        raise ValueError(f"prompt has shape {prompt.shape}; expected [batch, length >= 2].")
    cache = xkv_prefill(model, prompt[:, :-1], ratio=ratio, group_size=group_size, rank=rank,
                        value_rank_scale=value_rank_scale, selective=selective,
                        max_new_tokens=max_new_tokens, sink_tokens=sink_tokens)
    token, out = prompt[:, -1], []
    for _ in range(max_new_tokens):
        logits, cache = xkv_decode_step(model, cache, token, implementation=implementation)
        token = jnp.argmax(logits, axis=-1).astype(prompt.dtype)
        out.append(token)
    return jnp.stack(out, axis=1)


__all__ = [
    "AttentionInputsKV", "ContextKV", "PrefillKV", "XKVDecodeKV", "attention_inputs",
    "prefill_kv", "xkv_decode_step", "xkv_generate", "xkv_prefill",
]
