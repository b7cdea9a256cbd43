"""A Llama-style decoder in Flax NNX whose projections are dense, factorized or LoRA.

Module names follow HuggingFace's ``LlamaForCausalLM`` (``embed_tokens``,
``layers/i/self_attn/q_proj``, ``layers/i/mlp/gate_proj``, ``norm``, ``lm_head``) so that real
checkpoints load by name and LoRA adapters export to PEFT with the names PEFT expects.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.attention import get_attention
from lowrank_jax.nn.factorized import FactorizedLinear, check_rank

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class LlamaConfig:
    """Architecture of the decoder.

    ``projection`` is ``"dense"`` or ``"factorized"``; factorized layers get rank
    ``round(rank_ratio · min(in, out))`` (at least 1). LoRA is added afterwards with
    :func:`lowrank_jax.nn.apply_lora`. ``attention`` names an implementation registered in
    :mod:`lowrank_jax.attention`, or gives one name per layer (a tuple of ``n_layers`` names,
    e.g. from :func:`pallas_kernels.sparse_attention.api.register_sale_per_layer` for
    per-layer SALE thresholds; the layers are then unrolled instead of scanned).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int | None = None
    d_ff: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    projection: str = "dense"
    rank_ratio: float = 0.25
    attention: str | tuple[str, ...] = "reference"
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                    "max_seq_len"):
            value = getattr(self, key)
            least = 0 if key == "n_layers" else 1  # n_layers=0: the embedding-only shell
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                    and value >= least):
                raise ValueError(f"{key}={value!r} must be "
                                 f"{'an integer >= 0' if least == 0 else 'a positive integer'}.")
        for key in ("rope_theta", "norm_eps"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} must be > 0.")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; pick "
                    f"n_heads dividing d_model (or set head_dim explicitly)."
                )
            self.head_dim = self.d_model // self.n_heads
        if not (isinstance(self.head_dim, numbers.Integral) and self.head_dim >= 1):
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive integer.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}."
            )
        if self.projection not in ("dense", "factorized"):
            raise ValueError(
                f"projection={self.projection!r} is unknown; use 'dense' or 'factorized' "
                "(add LoRA with lowrank_jax.nn.apply_lora)."
            )
        if not 0.0 < self.rank_ratio <= 1.0:
            raise ValueError(f"rank_ratio={self.rank_ratio} must lie in (0, 1].")
        if isinstance(self.attention, list):  # e.g. read back from JSON / YAML
            self.attention = tuple(self.attention)
        if isinstance(self.attention, tuple) and len(self.attention) != self.n_layers:
            raise ValueError(
                f"attention has {len(self.attention)} per-layer names but n_layers="
                f"{self.n_layers}; give one name per layer or a single name for all."
            )

    def attention_for(self, layer: int) -> str:
        """The attention implementation name of decoder layer ``layer``."""
        return self.attention if isinstance(self.attention, str) else self.attention[layer]

    def rank_for(self, in_features: int, out_features: int) -> int:
        return max(1, int(round(self.rank_ratio * min(in_features, out_features))))


def _linear(cfg: LlamaConfig, d_in: int, d_out: int, rngs: nnx.Rngs, name: str):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    if cfg.projection == "factorized":
        rank = cfg.rank_for(d_in, d_out)
        check_rank(rank, d_in, d_out, f"{name}: ")
        return FactorizedLinear(d_in, d_out, rank, dtype=dtype, param_dtype=pdtype, rngs=rngs)
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=pdtype, rngs=rngs)


class RMSNorm(nnx.Module):
    """``x / rms(x) · weight`` computed in fp32 (parameter named ``weight`` as in HF)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float):
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x: Float[Array, "b t h d"], positions: Int[Array, "b t"], theta: float):
    """Rotary embedding in the HF "rotate half" pairing (dims ``i`` and ``i + d/2``)."""
    d = x.shape[-1]
    angles = positions[..., None].astype(jnp.float32) * rope_frequencies(d, theta)  # b t d/2
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class KVCache(NamedTuple):
    """Preallocated keys/values ``[layers, batch, max_len, kv_heads, head_dim]`` (post-RoPE)."""

    keys: Array
    values: Array
    length: Array  # shape=(), int32: how many positions are filled

    @classmethod
    def empty(cls, cfg: LlamaConfig, batch: int, max_len: int | None = None, dtype=None):
        max_len = max_len or cfg.max_seq_len
        shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        dtype = dtype or jnp.dtype(cfg.dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, hk, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, d, h * hd, rngs, "q_proj")
        self.k_proj = _linear(cfg, d, hk * hd, rngs, "k_proj")
        self.v_proj = _linear(cfg, d, hk * hd, rngs, "v_proj")
        self.o_proj = _linear(cfg, h * hd, d, rngs, "o_proj")

    def qkv(self, x):
        """Pre-RoPE ``q [b,t,h,d]``, ``k``, ``v [b,t,hk,d]``."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        return q, k, v

    def __call__(self, x, positions, *, layer_cache=None, cache_length=None, layer_idx=0):
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)
        attend = get_attention(cfg.attention_for(layer_idx))
        if layer_cache is None:
            out = attend(q, k, v, causal=True)
            new_cache = None
        else:
            ck, cv = layer_cache
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, cache_length, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, cache_length, 0, 0))
            out = attend(
                q, ck, cv, causal=True, q_offset=cache_length, kv_length=cache_length + t
            )
            new_cache = (ck, cv)
        return self.o_proj(out.reshape(b, t, cfg.n_heads * cfg.head_dim)), new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, "gate_proj")
        self.up_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, "up_proj")
        self.down_proj = _linear(cfg, cfg.d_ff, cfg.d_model, rngs, "down_proj")

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, *, layer_cache=None, cache_length=None, layer_idx=0):
        h, new_cache = self.self_attn(
            self.input_layernorm(x), positions, layer_cache=layer_cache,
            cache_length=cache_length, layer_idx=layer_idx,
        )
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_cache


class Llama(nnx.Module):
    """Decoder-only transformer: embed → N × (attn + SwiGLU MLP) → RMSNorm → LM head.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> cfg = LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        ...                   d_ff=64, projection="factorized")
        >>> model = Llama(cfg, rngs=nnx.Rngs(0))
        >>> logits, _ = model(jnp.zeros((1, 8), jnp.int32))
        >>> logits.shape
        (1, 8, 256)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.d_model, param_dtype=pdt, rngs=rngs,
            embedding_init=nnx.initializers.normal(stddev=0.02),
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
        if cfg.tie_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                      param_dtype=pdt, rngs=rngs)

    def hidden_states(self, tokens, positions=None, *, cache: KVCache | None = None):
        """Final-norm hidden states ``[b, t, d]`` and the updated cache."""
        b, t = tokens.shape
        start = 0 if cache is None else cache.length
        if positions is None:
            positions = jnp.broadcast_to(start + jnp.arange(t)[None, :], (b, t))
        x = self.embed_tokens(tokens).astype(jnp.dtype(self.cfg.dtype))
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache.keys[i], cache.values[i])
            x, lc = layer(x, positions, layer_cache=layer_cache, cache_length=start,
                          layer_idx=i)
            if lc is not None:
                new_keys.append(lc[0])
                new_values.append(lc[1])
        x = self.norm(x)
        if cache is not None:
            cache = KVCache(jnp.stack(new_keys), jnp.stack(new_values), cache.length + t)
        return x, cache

    def logits_from_hidden(self, x):
        if self.lm_head is None:
            return x.astype(jnp.float32) @ self.embed_tokens.embedding[...].astype(jnp.float32).T
        return self.lm_head(x).astype(jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        *,
        cache: KVCache | None = None,
    ) -> tuple[Float[Array, "b t vocab"], KVCache | None]:
        """Logits (fp32) for every position, and the cache advanced by ``t`` when one is given."""
        x, cache = self.hidden_states(tokens, positions, cache=cache)
        return self.logits_from_hidden(x), cache


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["Llama", "LlamaConfig", "KVCache", "RMSNorm", "apply_rope", "count_params",
           "PROJECTIONS"]
