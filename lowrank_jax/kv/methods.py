"""Every KV-cache method by name (:data:`KV_METHODS`), each meeting a target ratio with all bytes
counted, and one decode path (dense reconstruction of the compressed prompt) for all of them.

All methods are measured against the same reference, the exact cache stored in 16-bit floats
(``STORAGE_DTYPE``, the deployed format), and store their own float parts (factors, bases,
exact tokens, scales) in that dtype: :func:`stored_bytes` is the sum of the ``nbytes`` of the
arrays a cache holds, and :func:`cache_ratio` is ``reference_bytes / stored_bytes``.

======================  ==================================================================
``none``                the exact cache (fp16)
``xkv``                 xKV, groups of 4 layers, exact sink token (fp16 factors)
``per_layer_svd``       the same with ``G = 1``
``kivi``                KIVI quantized cache (keys per channel, values per token, residual
                        window); picks bits / group / window for the ratio
``xkv_quant``           xKV with 8-bit token factors and bases (ranks for the ratio)
``xkv_quant_energy``    ``xkv_quant`` with ranks allocated by spectrum energy across layer
                        groups and K vs V
``xkv_quant_hadamard``  xKV with 4-bit token factors and 8-bit bases, both stored rotated by a
                        randomized Hadamard transform per quantization group (more rank per
                        byte for V, but 4-bit keys lose on held-out text)
``xkv_quant_split``     xKV, keys at 8-bit factors, values at 4-bit factors (both Hadamard-
                        rotated, 8-bit bases): keys need precision, values rank
``xkv_quant_wide``      ``xkv_quant_split`` with token-factor quantization (and rotation)
                        groups of ``WIDE_QUANT_GROUP`` tokens instead of 32 (fewer fp16
                        scales / minima: more rank in the same bytes) and ``r_v / r_k``
                        1.25 instead of 1.5 (more of it to the keys)
``xkv_mixed``           xKV whose every singular direction gets its own bits (8/4/2/1 for
                        its token factor and its basis row, or dropped) by reverse water-
                        filling on the measured quantization errors; Hadamard-rotated,
                        clip-searched quantizers
======================  ==================================================================
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lowrank_jax.kv.cache import XKVCache, compressed_bytes
from lowrank_jax.kv.compress import xkv_compress, xkv_reconstruct
from lowrank_jax.kv.hybrid import QuantizedXKVCache, xkv_quant_compress, xkv_quant_reconstruct
from lowrank_jax.kv.mixed import MixedBitsXKVCache, xkv_mixed_compress, xkv_mixed_reconstruct
from lowrank_jax.kv.quantized import (
    STORAGE_DTYPE,
    KIVICache,
    choose_kivi_settings,
    kivi_compress,
    kivi_reconstruct,
)
from lowrank_jax.kv.ranks import DEFAULT_GROUP_SIZE, DEFAULT_SINK_TOKENS
from lowrank_jax.models.llama import KVProvider
from pallas_kernels.xkv_decode.reference import rope


@functools.partial(jax.tree_util.register_dataclass, data_fields=["keys", "values"],
                   meta_fields=["rope_theta"])
@dataclasses.dataclass(frozen=True)
class ExactCache:
    """The uncompressed prompt cache: pre-RoPE ``keys``, ``values [layers, b, L, hk, d]``."""

    keys: jax.Array
    values: jax.Array
    rope_theta: float

    @property
    def prefill_length(self) -> int:
        return self.keys.shape[2]


@dataclasses.dataclass(frozen=True)
class KVMethod:
    """A named cache method: ``compress(keys, values, *, ratio, rope_theta, **options)`` meets
    ``ratio`` (ignored by ``none``); ``reconstruct(cache, layer, kind)`` gives the dense fp32
    pre-RoPE prompt K or V ``[b, L, hk, d]``."""

    name: str
    summary: str
    compress: Callable
    reconstruct: Callable


def _none(keys, values, *, ratio=None, rope_theta, dtype=STORAGE_DTYPE, **_):
    return ExactCache(jnp.asarray(keys).astype(dtype), jnp.asarray(values).astype(dtype),
                      float(rope_theta))


def _default_group(group_size, keys) -> int:
    """``None`` → the xKV default 4, or every layer for models with fewer."""
    return min(DEFAULT_GROUP_SIZE, keys.shape[0]) if group_size is None else group_size


def _xkv(keys, values, *, ratio, rope_theta, group_size=None,
         sink_tokens=DEFAULT_SINK_TOKENS, rank=None, dtype=STORAGE_DTYPE, **options):
    group_size = _default_group(group_size, keys)
    return xkv_compress(keys, values, rope_theta=rope_theta, ratio=None if rank else ratio,
                        rank=rank, group_size=group_size, sink_tokens=sink_tokens, dtype=dtype,
                        **options)


def _per_layer(keys, values, **kwargs):
    kwargs["group_size"] = 1
    return _xkv(keys, values, **kwargs)


def _kivi(keys, values, *, ratio, rope_theta, sink_tokens=0, bits=None, group_size=None,
          residual=None, dtype=STORAGE_DTYPE, **_):
    layers, b, length, hk, d = keys.shape
    if bits is None:
        chosen = choose_kivi_settings(ratio, n_layers=layers, batch=b, tokens=length,
                                      kv_heads=hk, head_dim=d, sink_tokens=sink_tokens,
                                      dtype=dtype)
        bits, group_size, residual = chosen["bits"], chosen["group_size"], chosen["residual"]
    return kivi_compress(keys, values, rope_theta=rope_theta, bits=bits,
                         group_size=group_size or 32,
                         residual=128 if residual is None else residual,
                         sink_tokens=sink_tokens, dtype=dtype)


def _xkv_quant(keys, values, *, ratio, rope_theta, sink_tokens=DEFAULT_SINK_TOKENS, **options):
    rank = options.pop("rank", None)
    options["group_size"] = _default_group(options.get("group_size"), keys)
    return xkv_quant_compress(keys, values, rope_theta=rope_theta,
                              ratio=None if rank else ratio, rank=rank, sink_tokens=sink_tokens,
                              **options)


def _xkv_quant_energy(keys, values, **kwargs):
    kwargs.setdefault("allocation", "energy")
    return _xkv_quant(keys, values, **kwargs)


def _xkv_quant_hadamard(keys, values, **kwargs):
    kwargs.setdefault("hadamard", True)
    kwargs.setdefault("factor_bits", 4)
    return _xkv_quant(keys, values, **kwargs)


def _xkv_quant_split(keys, values, **kwargs):
    kwargs.setdefault("hadamard", True)
    kwargs.setdefault("factor_bits", 8)
    kwargs.setdefault("value_factor_bits", 4)
    return _xkv_quant(keys, values, **kwargs)


WIDE_QUANT_GROUP = 256  # tokens per quantization / Hadamard group of xkv_quant_wide's factors
WIDE_VALUE_RANK_SCALE = 1.25  # r_v / r_k of xkv_quant_wide (chosen on the explore windows)


def _xkv_quant_wide(keys, values, **kwargs):
    kwargs.setdefault("quant_group", WIDE_QUANT_GROUP)
    kwargs.setdefault("value_rank_scale", WIDE_VALUE_RANK_SCALE)
    return _xkv_quant_split(keys, values, **kwargs)


def _xkv_mixed(keys, values, *, ratio, rope_theta, sink_tokens=DEFAULT_SINK_TOKENS,
               **options):
    rank = options.pop("rank", None)
    options["group_size"] = _default_group(options.get("group_size"), keys)
    return xkv_mixed_compress(keys, values, rope_theta=rope_theta,
                              ratio=None if rank else ratio, rank=rank, sink_tokens=sink_tokens,
                              **options)


def _exact_reconstruct(cache: ExactCache, layer, kind="k"):
    return (cache.keys if kind == "k" else cache.values)[layer].astype(jnp.float32)


#: The KV-cache compression methods by name (``lowrank-jax eval --kv-method``).
KV_METHODS: dict[str, KVMethod] = {
    m.name: m for m in (
        KVMethod("none", "exact cache (fp16)", _none, _exact_reconstruct),
        KVMethod("xkv", "xKV cross-layer SVD, fp16 factors", _xkv, xkv_reconstruct),
        KVMethod("per_layer_svd", "per-layer SVD (xKV with G = 1)", _per_layer,
                 xkv_reconstruct),
        KVMethod("kivi", "KIVI quantized cache", _kivi, kivi_reconstruct),
        KVMethod("xkv_quant", "xKV with quantized factors", _xkv_quant, xkv_quant_reconstruct),
        KVMethod("xkv_quant_energy", "xkv_quant, ranks by spectrum energy", _xkv_quant_energy,
                 xkv_quant_reconstruct),
        KVMethod("xkv_quant_hadamard", "xKV, 4-bit Hadamard-rotated factors",
                 _xkv_quant_hadamard, xkv_quant_reconstruct),
        KVMethod("xkv_quant_split", "xKV, 8-bit key / 4-bit value factors (Hadamard)",
                 _xkv_quant_split, xkv_quant_reconstruct),
        KVMethod("xkv_quant_wide", "xkv_quant_split, 256-token factor groups, r_v/r_k 1.25",
                 _xkv_quant_wide, xkv_quant_reconstruct),
        KVMethod("xkv_mixed", "xKV, bits per singular direction by reverse water-filling",
                 _xkv_mixed, xkv_mixed_reconstruct),
    )
}


def get_method(name: str) -> KVMethod:
    """The :class:`KVMethod` called ``name`` (a clear error for unknown names)."""
    if name not in KV_METHODS:
        raise ValueError(f"KV method {name!r} is unknown; choose from {sorted(KV_METHODS)}.")
    return KV_METHODS[name]


def compress_kv(method: str, keys, values, *, rope_theta: float, ratio: float | None = 8.0,
                **options):
    """Compress a prefilled cache with ``method`` at ``ratio`` (the method picks its ranks /
    bits so that :func:`cache_ratio` ``>= ratio``, everything counted).

    Example::

        >>> import jax
        >>> k = jax.random.normal(jax.random.key(0), (2, 1, 64, 1, 8))
        >>> cache = compress_kv("kivi", k, k, rope_theta=1e4, ratio=2.0)
        >>> cache_ratio(cache) >= 2.0
        True
    """
    if method != "none" and (ratio is None or not ratio > 0):
        if "rank" not in options and "bits" not in options:
            raise ValueError(f"ratio={ratio!r} must be > 0 for method {method!r} (e.g. 8).")
    return get_method(method).compress(keys, values, ratio=ratio, rope_theta=rope_theta,
                                       **options)


def stored_bytes(cache) -> int:
    """Bytes of every array the cache holds (an :class:`XKVCache` counts its filled tail)."""
    if isinstance(cache, XKVCache):
        return compressed_bytes(cache)
    return sum(int(x.nbytes) for x in jax.tree.leaves(cache))


def _shape(cache):
    if isinstance(cache, ExactCache):
        layers, b, _, hk, d = cache.keys.shape
    elif isinstance(cache, KIVICache):
        layers, b, _, hk, d = cache.sink_keys.shape
    elif isinstance(cache, (XKVCache, QuantizedXKVCache, MixedBitsXKVCache)):
        layers, b, _, hk, d = cache.sink_keys.shape
    else:
        raise ValueError(f"cache of type {type(cache).__name__} is not a KV-method cache.")
    return layers, b, hk, d


def reference_bytes(cache, dtype=STORAGE_DTYPE) -> int:
    """Bytes of the exact cache of the same prompt in ``dtype`` (``2·N·b·L·H_kv·D·itemsize``)."""
    layers, b, hk, d = _shape(cache)
    tokens = cache.prefill_length + (int(cache.tail_length) if isinstance(cache, XKVCache) else 0)
    return 2 * layers * b * tokens * hk * d * jnp.dtype(dtype).itemsize


def cache_ratio(cache) -> float:
    """``reference_bytes / stored_bytes`` (> 1: smaller than the exact fp16 cache)."""
    return reference_bytes(cache) / stored_bytes(cache)


def reconstruct_all(method: str, cache):
    """Dense fp32 pre-RoPE ``(keys, values)`` ``[layers, b, L, hk, d]`` of the prompt."""
    m = get_method(method)
    layers = _shape(cache)[0]
    return (jnp.stack([m.reconstruct(cache, l, "k") for l in range(layers)]),
            jnp.stack([m.reconstruct(cache, l, "v") for l in range(layers)]))


# --------------------------------------------------------------------------------------------
# decoding from any compressed cache
# --------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cache", "tail_keys", "tail_values", "tail_length"],
                   meta_fields=["method"])
@dataclasses.dataclass(frozen=True)
class ReconstructDecodeKV(KVProvider):
    """One decode step against any :data:`KV_METHODS` cache: per layer, the prompt K/V are rebuilt
    (dequantized / multiplied out, in fp32, inside the jitted step), RoPE-rotated at
    ``0..L-1`` and attended together with the exact post-RoPE tail. Only the compressed prompt
    and the tail persist between steps."""

    cache: object
    tail_keys: jax.Array
    tail_values: jax.Array
    tail_length: jax.Array
    method: str

    scannable = False

    def start(self):
        return self.cache.prefill_length + self.tail_length

    def attend(self, layer, layer_data, q, k, v, keys_pre_rope, attention):
        step = self.tail_length
        tk = jax.lax.dynamic_update_slice(self.tail_keys[layer], k.astype(self.tail_keys.dtype),
                                          (0, step, 0, 0))
        tv = jax.lax.dynamic_update_slice(self.tail_values[layer],
                                          v.astype(self.tail_values.dtype), (0, step, 0, 0))
        m = KV_METHODS[self.method]
        length = self.cache.prefill_length
        pk = rope(m.reconstruct(self.cache, layer, "k"), jnp.arange(length),
                  self.cache.rope_theta)
        pv = m.reconstruct(self.cache, layer, "v")
        keys = jnp.concatenate([pk.astype(q.dtype), tk.astype(q.dtype)], axis=1)
        vals = jnp.concatenate([pv.astype(q.dtype), tv.astype(q.dtype)], axis=1)
        out = attention(q, keys, vals, causal=True, q_offset=length + step,
                        kv_length=length + step + q.shape[1])
        return out, (tk, tv)

    def advance(self, updates, length):
        return dataclasses.replace(self, tail_keys=jnp.stack([u[0] for u in updates]),
                                   tail_values=jnp.stack([u[1] for u in updates]),
                                   tail_length=self.tail_length + length)


def start_decode(method: str, cache, *, max_new_tokens: int) -> ReconstructDecodeKV:
    """A :class:`ReconstructDecodeKV` with room for ``max_new_tokens`` exact tail tokens."""
    get_method(method)
    layers, b, hk, d = _shape(cache)
    shape = (layers, b, max_new_tokens, hk, d)
    return ReconstructDecodeKV(cache, jnp.zeros(shape, STORAGE_DTYPE),
                               jnp.zeros(shape, STORAGE_DTYPE), jnp.zeros((), jnp.int32), method)


@nnx.jit
def _cache_step(model, cache, token):
    logits, cache = model(token[:, None], cache=cache)
    return logits[:, 0], cache


def cache_step(model, cache, token):
    """One jitted decode step of ``model`` against any cache it takes (a
    :class:`~lowrank_jax.models.KVCache`, a :class:`ReconstructDecodeKV`):
    ``(logits [b, vocab], advanced cache)``."""
    return _cache_step(model, cache, jnp.asarray(token))


def kv_decode_step(model, provider: ReconstructDecodeKV, token):
    """Feed one token per sequence: ``(logits [b, vocab], advanced provider)``."""
    if int(provider.tail_length) >= provider.tail_keys.shape[2]:
        raise ValueError(f"the exact tail is full ({provider.tail_keys.shape[2]} tokens); start "
                         "decoding with a larger max_new_tokens.")
    return cache_step(model, provider, token)


def start_kv_decode(model, keys, values, *, method: str, ratio: float | None,
                    max_new_tokens: int, **options):
    """``(state, step)``: the prompt's K/V compressed by ``method`` with room for
    ``max_new_tokens``, and ``step(state, token) -> (logits, state)``.

    ``xkv`` / ``per_layer_svd`` decode through the xKV kernel path
    (:func:`lowrank_jax.kv.xkv_decode_step`, their ``state`` is the cache); the other methods
    through :class:`ReconstructDecodeKV` (``state.cache`` is the compressed cache);
    :func:`kv_generate` decodes with it.
    """
    from lowrank_jax.kv.model import xkv_decode_step

    get_method(method)
    theta = model.cfg.rope_theta
    if method in ("xkv", "per_layer_svd"):
        cache = compress_kv(method, keys, values, rope_theta=theta, ratio=ratio,
                            tail_capacity=max_new_tokens, **options)
        return cache, lambda c, t: xkv_decode_step(model, c, t)
    cache = compress_kv(method, keys, values, rope_theta=theta, ratio=ratio, **options)
    return (start_decode(method, cache, max_new_tokens=max_new_tokens),
            lambda c, t: kv_decode_step(model, c, t))


def kv_generate(model, prompt, *, method: str, ratio: float | None = 8.0, max_new_tokens: int,
                **options):
    """Greedy generation with the prompt (minus its last token) compressed by ``method``.

    ``xkv`` / ``per_layer_svd`` decode through the xKV kernel path
    (:func:`lowrank_jax.kv.xkv_decode_step`); the other methods through
    :class:`ReconstructDecodeKV`.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> kv_generate(model, jnp.zeros((1, 40), jnp.int32), method="kivi", ratio=2.0,
        ...             max_new_tokens=2).shape
        (1, 2)
    """
    from lowrank_jax.kv.model import prefill_kv

    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 2:
        raise ValueError(f"prompt has shape {prompt.shape}; expected [batch, length >= 2].")
    get_method(method)
    keys, values = prefill_kv(model, prompt[:, :-1])
    token, out = prompt[:, -1], []
    cache, step = start_kv_decode(model, keys, values, method=method, ratio=ratio,
                                  max_new_tokens=max_new_tokens, **options)
    for _ in range(max_new_tokens):
        logits, cache = step(cache, token)
        token = jnp.argmax(logits, axis=-1).astype(prompt.dtype)
        out.append(token)
    return jnp.stack(out, axis=1)


__all__ = [
    "KV_METHODS", "ExactCache", "KVMethod", "ReconstructDecodeKV", "cache_ratio", "cache_step",
    "compress_kv", "kv_decode_step", "get_method", "kv_generate", "reconstruct_all",
    "reference_bytes", "start_decode", "start_kv_decode", "stored_bytes",
]
