"""A Llama-style decoder in Flax NNX whose projections are dense, factorized or LoRA.

Module names follow HuggingFace's ``LlamaForCausalLM`` (``embed_tokens``,
``layers/i/self_attn/q_proj``, ``layers/i/mlp/gate_proj``, ``norm``, ``lm_head``) so that real
checkpoints load by name and LoRA adapters export to PEFT with the names PEFT expects.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels.rope import RopeFrequencies, rope

from lowrank_jax.attention import get_attention
from lowrank_jax.models.config import HIDDEN_ACTS, LAYER_TYPES, LlamaConfig
from lowrank_jax.models.kv_provider import CausalKV, KVCache, KVProvider, as_provider
from lowrank_jax.nn.factorized import FactorizedLinear, check_rank

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
def _linear(cfg: LlamaConfig, d_in: int, d_out: int, rngs: nnx.Rngs, name: str,
            use_bias: bool = False):
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    if cfg.projection == "factorized":
        rank = cfg.rank_for(d_in, d_out)
        check_rank(rank, d_in, d_out, f"{name}: ")
        return FactorizedLinear(d_in, d_out, rank, use_bias=use_bias, dtype=dtype,
                                param_dtype=pdtype, rngs=rngs)
    return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=pdtype,
                      rngs=rngs)


class RMSNorm(nnx.Module):
    """``x / rms(x) · (offset + weight)`` computed in fp32 (parameter named ``weight`` as in HF).

    ``offset=1`` is Gemma's form (weights stored near 0, initialised at 0)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32,
                 offset: float = 0.0):
        self.eps = eps
        self.offset = float(offset)
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - self.offset, param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = self.weight[...].astype(jnp.float32)
        if self.offset:
            weight = weight + self.offset
        return (normed * weight).astype(x.dtype)


def apply_rope(x: Float[Array, "b t h d"], positions: Int[Array, "b t"],
               theta: float | RopeFrequencies):
    """Rotary embedding in the HF "rotate half" pairing (dims ``i`` and ``i + d/2``), computed in
    fp32 and returned in ``x``'s dtype: the package's one RoPE, :func:`pallas_kernels.rope.rope`
    (the kernels cannot import the library, so the library uses theirs).

    ``theta`` is a base, or a layer's :class:`~pallas_kernels.rope.RopeFrequencies`
    (:meth:`LlamaConfig.rope_for`: scaled, partial or longrope frequencies)."""
    if not isinstance(theta, RopeFrequencies):
        return rope(x, positions, theta, dtype=x.dtype)
    inv = theta.inv_freq
    if theta.long_inv_freq is not None:  # longrope: long factors once a position passes old_ctx
        long = jnp.max(positions) >= theta.original_max_position_embeddings
        inv = jnp.where(long, theta.long_inv_freq, theta.inv_freq)
    return rope(x, positions, dtype=x.dtype, inv_freq=inv,
                attention_scaling=theta.attention_scaling)


def project(x, modules):
    """The outputs of several projections of the same input ``x``: one matmul when they are the
    parts of one fused kernel (:func:`lowrank_jax.models.fused.fuse_projections`), else each
    module called in turn."""
    joint = getattr(modules[0], "joint", None)
    out = None if joint is None else joint(x, modules)
    return [m(x) for m in modules] if out is None else out


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, hk, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = _linear(cfg, d, h * hd, rngs, "q_proj", cfg.qkv_bias)
        self.k_proj = _linear(cfg, d, hk * hd, rngs, "k_proj", cfg.qkv_bias)
        self.v_proj = _linear(cfg, d, hk * hd, rngs, "v_proj", cfg.qkv_bias)
        self.o_proj = _linear(cfg, h * hd, d, rngs, "o_proj", cfg.o_bias)
        if cfg.qk_norm:  # per-head norms of q and k before RoPE (Qwen3, Gemma 3)
            pdt = jnp.dtype(cfg.param_dtype)
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pdt, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pdt, offset=cfg.norm_offset)

    def qkv(self, x):
        """Pre-RoPE ``q [b,t,h,d]``, ``k``, ``v [b,t,hk,d]`` (after the q/k norms if any)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)

    def attention_fn(self, layer_idx: int):
        """The dispatcher's implementation for this layer, with the layer's window, soft-cap
        and score scale bound (keywords passed only when set)."""
        cfg = self.cfg
        attend = get_attention(cfg.attention_for(layer_idx))
        extra = {}
        if cfg.window_for(layer_idx) is not None:
            extra["window"] = int(cfg.window_for(layer_idx))
        if cfg.attn_logit_softcap is not None:
            extra["logit_softcap"] = float(cfg.attn_logit_softcap)
        if cfg.query_pre_attn_scalar is not None:
            extra["scale"] = float(cfg.query_pre_attn_scalar) ** -0.5
        return functools.partial(attend, **extra) if extra else attend

    def __call__(self, x, positions, *, kv: KVProvider | None = None, layer_data=None,
                 layer_idx=0):
        """Attention output ``[b, t, d]`` and the K/V provider's update for this layer."""
        cfg = self.cfg
        b, t, _ = x.shape
        kv = CausalKV() if kv is None else kv
        q, k, v = self.qkv(x)
        freqs = cfg.rope_for(layer_idx)
        plain = (freqs.long_inv_freq is None and freqs.attention_scaling == 1.0
                 and not cfg.rope_scaling and cfg.partial_rotary_factor == 1.0
                 and cfg.rope_local_theta is None)
        theta = cfg.rope_theta if plain else freqs  # plain RoPE: today's exact computation
        q_rot = apply_rope(q, positions, theta)
        k_rot = apply_rope(k, positions, theta)
        out, update = kv.attend(layer_idx, layer_data, q_rot, k_rot, v, k,
                                self.attention_fn(layer_idx))
        out = out.reshape(b, t, cfg.n_heads * cfg.head_dim).astype(x.dtype)
        return self.o_proj(out), update


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.act = cfg.hidden_act
        self.gate_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, "gate_proj")
        self.up_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs, "up_proj")
        self.down_proj = _linear(cfg, cfg.d_ff, cfg.d_model, rngs, "down_proj")

    def __call__(self, x):
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(HIDDEN_ACTS[self.act](gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm block ``x + attn(norm(x))``, ``x + mlp(norm(x))``.

    With ``cfg.sandwich_norms`` (Gemma 2/3) the attention and MLP outputs are normalised too,
    and the HF names move: ``post_attention_layernorm`` normalises the attention output and
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` wrap the MLP.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        norm = functools.partial(RMSNorm, cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt,
                                 offset=cfg.norm_offset)
        self.sandwich = bool(cfg.sandwich_norms)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, rngs=rngs)
        self.remat = bool(cfg.remat)

    def __call__(self, x, positions=None, *, kv: KVProvider | None = None, layer_data=None,
                 layer_idx=0):
        """``x + attn``, then ``+ mlp``; returns ``(x, kv update)``. ``positions`` default
        ``0..t-1`` (a block on its own, as the layer-by-layer quantization pipeline runs it)."""
        if positions is None:
            b, t = x.shape[:2]
            positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
        h, update = self.self_attn(self.input_layernorm(x), positions, kv=kv,
                                   layer_data=layer_data, layer_idx=layer_idx)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
            return x, update
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, update


def batch_sharded(x, last: str | None = None):
    """``x [b, ...]`` pinned to the batch split ``("data", "fsdp")`` (and its last axis to
    ``last``) when traced under a mesh with axes ``data``, ``fsdp``, ``tensor`` (``jax.set_mesh``,
    as ``pretrain``'s step and ``lowrank-jax compile`` run); unchanged otherwise.

    The residual stream and the logits carry it: without it XLA's propagation follows the
    ``fsdp``-sharded weights and computes every layer on the whole batch on every device
    (docs/guides/pod.md: 64 times the activations on the v5e-256 config).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"data", "fsdp", "tensor"} <= set(mesh.axis_names):
        return x
    if x.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]):
        return x
    spec = jax.sharding.PartitionSpec(("data", "fsdp"), *([None] * (x.ndim - 2)), last)
    return jax.lax.with_sharding_constraint(x, spec)


class ScannedLayers(NamedTuple):
    """Decoder layers of one shared structure, their states stacked on a leading axis."""

    graph: Any  # nnx.GraphDef of one DecoderLayer
    state: Any  # its state, every leaf with a leading n_layers axis


def run_layers(layers, x, positions, kv: KVProvider):
    """THE decoder-layer loop: every forward of the package runs its layers here.

    ``layers`` is a sequence of :class:`DecoderLayer` (unrolled Python loop) or
    :class:`ScannedLayers` (``jax.lax.scan``: XLA compiles one layer, not ``n_layers``; needs a
    ``kv.scannable`` provider). Returns the hidden states and ``kv.advance(...)``.
    """
    data = kv.per_layer()
    t = x.shape[1]
    if isinstance(layers, ScannedLayers):
        if not kv.scannable:
            raise ValueError(
                f"cache={type(kv).__name__} is not scannable (its attention depends on the "
                "layer index); run the layers unrolled (prepare(model, scan_layers=False))."
            )

        def body(x, xs):
            layer_state, layer_data = xs
            layer = nnx.merge(layers.graph, layer_state)
            cfg = getattr(getattr(layer, "self_attn", None), "cfg", None)
            if cfg is not None and not cfg.uniform_layers:
                raise ValueError(
                    "the decoder layers differ (layer_types / per-layer attention); run them "
                    "unrolled (prepare(model, scan_layers=False) does so by itself).")
            return layer(x, positions, kv=kv, layer_data=layer_data, layer_idx=0)

        x, updates = jax.lax.scan(body, x, (layers.state, data))
        return x, kv.advance(updates, t)
    updates = []
    for i, layer in enumerate(layers):
        layer_data = None if data is None else jax.tree.map(lambda a: a[i], data)
        if getattr(layer, "remat", False):  # LlamaConfig.remat: recompute in the backward pass
            graph, state = nnx.split(layer)
            call = lambda state, x, p, d, i=i: nnx.merge(graph, state)(  # noqa: E731
                x, p, kv=kv, layer_data=d, layer_idx=i)
            x, update = jax.checkpoint(call)(state, x, positions, layer_data)
        else:
            x, update = layer(x, positions, kv=kv, layer_data=layer_data, layer_idx=i)
        x = batch_sharded(x)
        updates.append(update)
    if kv.scannable:
        updates = jax.tree.map(lambda *u: jnp.stack(u), *updates)
    return x, kv.advance(updates, t)


def decoder_forward(embed, layers, norm, tokens, positions=None, *, cache=None, dtype="float32",
                    embed_scale: float | None = None):
    """Embed (× ``embed_scale``, Gemma's ``sqrt(d)`` in the compute dtype) → :func:`run_layers`
    → final norm: hidden states ``[b, t, d]`` and the new cache."""
    kv = as_provider(cache)
    b, t = tokens.shape
    if positions is None:
        positions = kv.positions(b, t)
    x = embed(tokens).astype(jnp.dtype(dtype))
    if embed_scale is not None:
        x = x * jnp.asarray(embed_scale, x.dtype)
    x = batch_sharded(x)
    x, new_cache = run_layers(layers, x, positions, kv)
    return norm(x), new_cache


def lm_logits(x, embed, lm_head=None, softcap: float | None = None):
    """fp32 logits from final hidden states (tied embeddings when ``lm_head`` is ``None``),
    soft-capped ``c · tanh(logits / c)`` when ``softcap`` is set (Gemma 2)."""
    if lm_head is None:
        logits = x.astype(jnp.float32) @ embed.embedding[...].astype(jnp.float32).T
    else:
        logits = lm_head(x).astype(jnp.float32)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return logits


def embedding_scale(cfg: LlamaConfig) -> float | None:
    """``sqrt(d_model)`` when ``cfg.embed_scale`` (Gemma), else ``None``."""
    return float(cfg.d_model) ** 0.5 if cfg.embed_scale else None


class Llama(nnx.Module):
    """Decoder-only transformer: embed → N × (attn + SwiGLU MLP) → RMSNorm → LM head.

    Extension points (instead of copies of the layer loop):

    (a) K/V: ``model(tokens, cache=provider)`` with any :class:`KVProvider`;
    (b) linear layers: :func:`replace_projections` swaps the module behind a projection (LoRA,
        multi-LoRA, quantized, or your own ``y = f(x)`` module);
    (c) capture: :func:`lowrank_jax.nn.capture.capture` records the inputs/outputs of any
        submodule during a normal forward.

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
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt,
                            offset=cfg.norm_offset)
        if cfg.tie_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                      param_dtype=pdt, rngs=rngs)

    def hidden_states(self, tokens, positions=None, *, cache=None):
        """Final-norm hidden states ``[b, t, d]`` and the updated cache."""
        return decoder_forward(self.embed_tokens, list(self.layers), self.norm, tokens,
                               positions, cache=cache, dtype=self.cfg.dtype,
                               embed_scale=embedding_scale(self.cfg))

    def logits_from_hidden(self, x):
        return lm_logits(x, self.embed_tokens, self.lm_head, self.cfg.final_logit_softcap)

    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"] | None = None,
        *,
        cache: KVProvider | None = None,
    ) -> tuple[Float[Array, "b t vocab"], Any]:
        """Logits (fp32) for every position, and the cache advanced by ``t`` when one is given."""
        x, cache = self.hidden_states(tokens, positions, cache=cache)
        return batch_sharded(self.logits_from_hidden(x), "tensor"), cache


def projections(model: Llama) -> list[tuple[int, str, nnx.Module, nnx.Module]]:
    """``(layer, name, parent, module)`` for the 7 projections of every decoder layer."""
    out = []
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            parent = layer.self_attn if name in ATTENTION_PROJECTIONS else layer.mlp
            out.append((i, name, parent, getattr(parent, name)))
    return out


def layer_norms(model: Llama) -> list[tuple[int, str, nnx.Module]]:
    """``(layer, name, module)`` for the RMSNorms of every decoder layer (two, four with
    sandwich norms, and ``self_attn.q_norm`` / ``self_attn.k_norm`` with q/k norms)."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")
    out = []
    for i, layer in enumerate(model.layers):
        out += [(i, name, getattr(layer, name)) for name in names if hasattr(layer, name)]
        out += [(i, f"self_attn.{name}", getattr(layer.self_attn, name))
                for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)]
    return out


def replace_projections(
    model: Llama, make: Callable[[int, str, nnx.Module], nnx.Module | None], *,
    layers: Sequence[int] | None = None,
) -> list[str]:
    """Extension point (b): choose the linear implementation behind each projection.

    ``make(layer, name, current)`` returns the new module (anything mapping ``[..., in]`` to
    ``[..., out]``: LoRA, quantized, your own) or ``None`` to keep the current one. The module
    paths stay ``layers/i/self_attn/q_proj`` etc., so checkpoints and adapters keep their names.

    Returns:
        The paths that were replaced.

    Example::

        >>> from flax import nnx
        >>> m = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2,
        ...                       n_kv_heads=2, d_ff=16), rngs=nnx.Rngs(0))
        >>> replace_projections(m, lambda i, name, lin: lin if name == "q_proj" else None)
        ['layers/0/self_attn/q_proj']
    """
    chosen = None if layers is None else set(layers)
    replaced = []
    for i, name, parent, module in projections(model):
        if chosen is not None and i not in chosen:
            continue
        new = make(i, name, module)
        if new is not None:
            setattr(parent, name, new)
            block = "self_attn" if name in ATTENTION_PROJECTIONS else "mlp"
            replaced.append(f"layers/{i}/{block}/{name}")
    return replaced


def with_attention(model: Llama, attention: str | tuple[str, ...]) -> Llama:
    """The same model (same parameter arrays) running another attention implementation.

    ``attention`` is a name registered in :mod:`lowrank_jax.attention` or one per layer (e.g.
    :func:`lowrank_jax.attention.register_sale_per_layer`). The copy gets its own
    :class:`LlamaConfig`, so ``model`` is untouched and jitted runners never confuse the two.

    Example::

        >>> from flax import nnx
        >>> m = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2,
        ...                       n_kv_heads=2, d_ff=16), rngs=nnx.Rngs(0))
        >>> other = with_attention(m, ("reference", "flash"))
        >>> other.layers[1].self_attn.cfg.attention_for(1), m.cfg.attention
        ('flash', 'reference')
    """
    old = model.cfg
    cfg = dataclasses.replace(old, attention=attention)
    copy = nnx.clone(model)
    for _, module in nnx.iter_modules(copy):
        if getattr(module, "cfg", None) is old or getattr(module, "cfg", None) == old:
            module.cfg = cfg
    return copy


def count_params(model: nnx.Module) -> int:
    """The number of trainable scalars (every ``nnx.Param`` leaf) of ``model``."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["ATTENTION_PROJECTIONS", "HIDDEN_ACTS", "LAYER_TYPES", "CausalKV", "KVCache",
           "KVProvider", "Llama", "LlamaConfig", "PROJECTIONS", "RMSNorm", "ScannedLayers",
           "apply_rope", "as_provider", "count_params", "decoder_forward", "embedding_scale",
           "layer_norms", "lm_logits", "project", "projections", "replace_projections",
           "run_layers", "with_attention"]
