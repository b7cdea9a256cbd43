"""Doc-to-LoRA: a Perceiver hypernetwork that turns a document into a LoRA adapter in one pass.

The frozen base model reads the document (split into chunks); the inputs of the targeted decoder
layers are its context features ``[chunks, layers, T, d_model]``. A shared Perceiver resampler
compresses each layer's variable-length sequence into ``rank`` latent codes, and a per-layer
linear head turns code ``j`` into row ``j`` of ``A`` (``d_in``) and of ``B`` (``d_out``) of that
layer's adapter. The chunks' adapters are concatenated along the rank axis, followed by a
context-independent bias LoRA:

.. math:: A = [A_1; \\dots; A_C; A_{bias}],\\quad
          \\Delta W = s \\sum_c B_c^\\top A_c + s\\, B_{bias}^\\top A_{bias},\\quad s = 2 r^{3/2}

The B scalers and ``B_bias`` start at zero, so the generated update is exactly zero at init.
The adapter is applied through the capture extension point (:mod:`lowrank_jax.nn.capture`): no
projection of the base model is replaced, and one model serves every document.

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from lowrank_jax.models.presets import preset_model
    >>> base = preset_model("tiny")
    >>> hyper = DocToLoRA.for_model(base, layers=(0, 1), rank=2, d_latent=16, n_latents=4,
    ...                             num_blocks=1, rngs=nnx.Rngs(0))
    >>> bank = internalize(base, hyper, list(range(40)), chunk_len=16)
    >>> bank.a.shape  # [docs, layers, (chunks + 1) * rank, d_ff]
    (1, 2, 8, 128)

References:
    Charakorn et al, `Doc-to-LoRA: Learning to Instantly Internalize Contexts
    <https://arxiv.org/abs/2602.15902>`_, 2026.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.nn.capture import Recorder, capture, recording, tapped
from lowrank_jax.nn.lora import lora_output

from lowrank_jax.models.llama import PROJECTIONS as TARGETS  # noqa: E402 (one list)


def default_alpha(rank: int) -> float:
    """D2L's adapter scale ``s = 2 r^{3/2}`` (applied directly, not divided by the rank)."""
    return 2.0 * rank ** 1.5


def target_path(layer: int, target: str) -> str:
    """``(3, "down_proj")`` → ``"layers/3/mlp/down_proj"`` (the model's module path)."""
    block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"layers/{layer}/{block}/{target}"


@dataclasses.dataclass(frozen=True)
class DocToLoRAConfig:
    """Shapes and hyperparameters of a :class:`DocToLoRA` hypernetwork.

    Args:
        layers: decoder layers that get an adapter (their inputs are the context features).
        d_model: width of the context features (the base model's ``d_model``).
        d_in, d_out: input / output width of the targeted projection.
        target: the projection name (``"down_proj"`` in the paper's main runs).
        rank: rank ``r`` generated per chunk (and of the bias LoRA).
        d_latent: width of the Perceiver latents.
        n_latents: learned latents of the encoder resampler.
        num_blocks: cross-attention blocks of the encoder resampler.
        n_heads: attention heads of the resampler (must divide ``d_latent``).
        alpha: adapter scale ``s`` (``None``: ``2 r^{3/2}``).
        bias_scaler: multiplier of the context-independent bias LoRA.
    """

    layers: tuple[int, ...]
    d_model: int
    d_in: int
    d_out: int
    target: str = "down_proj"
    rank: int = 8
    d_latent: int = 512
    n_latents: int = 8
    num_blocks: int = 9
    n_heads: int = 4
    alpha: float | None = None
    bias_scaler: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers={self.layers!r} must name at least one decoder layer, "
                             "each once, e.g. layers=(8, 12).")
        for key in ("d_model", "d_in", "d_out", "rank", "d_latent", "n_latents", "num_blocks",
                    "n_heads"):
            value = getattr(self, key)
            if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                    and value >= 1):
                raise ValueError(f"{key}={value!r} must be a positive integer.")
        if self.d_latent % self.n_heads:
            raise ValueError(f"d_latent={self.d_latent} is not divisible by n_heads="
                             f"{self.n_heads}; pick n_heads dividing d_latent.")
        if self.target not in TARGETS:
            raise ValueError(f"target={self.target!r} is unknown; use one of {', '.join(TARGETS)}.")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"alpha={self.alpha!r} must be > 0 (None: 2·rank^1.5).")

    @property
    def scale(self) -> float:
        return default_alpha(self.rank) if self.alpha is None else float(self.alpha)

    @property
    def paths(self) -> list[str]:
        return [target_path(i, self.target) for i in self.layers]


class LoRABank(NamedTuple):
    """Generated adapters of ``D`` documents for ``L`` layers of one projection.

    ``a [D, L, R, d_in]``, ``b [D, L, R, d_out]``; the update of layer ``l`` for document
    ``d`` is ``y += s · (x a[d, l]ᵀ) b[d, l]``.
    """

    a: jax.Array
    b: jax.Array


def _rms(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _layer_norm(x, eps=1e-5):
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return _rms(x, eps)


class PerceiverBlock(nnx.Module):
    """Latents attend to ``concat(context, latents)``; RMSNorm before and after attention and
    MLP (Idefics2-style), residual around both."""

    def __init__(self, d_context: int, d_latent: int, n_heads: int, *, rngs: nnx.Rngs):
        self.n_heads = n_heads
        self.norm_latents = nnx.RMSNorm(d_latent, rngs=rngs)
        self.norm_context = nnx.RMSNorm(d_context, rngs=rngs)
        self.q = nnx.Linear(d_latent, d_latent, use_bias=False, rngs=rngs)
        self.kv_context = nnx.Linear(d_context, 2 * d_latent, use_bias=False, rngs=rngs)
        self.kv_latents = nnx.Linear(d_latent, 2 * d_latent, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_latent, d_latent, use_bias=False, rngs=rngs)
        self.post_attention_norm = nnx.RMSNorm(d_latent, rngs=rngs)
        self.pre_mlp_norm = nnx.RMSNorm(d_latent, rngs=rngs)
        self.mlp_in = nnx.Linear(d_latent, 4 * d_latent, use_bias=False, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d_latent, d_latent, use_bias=False, rngs=rngs)
        self.post_mlp_norm = nnx.RMSNorm(d_latent, rngs=rngs)

    def __call__(self, latents, context, mask):
        """``latents [B, N, k]``, ``context [B, T, d]``, ``mask [B, T]`` → ``[B, N, k]``."""
        b, n, k = latents.shape
        h = self.n_heads
        lat = self.norm_latents(latents)
        kv = jnp.concatenate([self.kv_context(self.norm_context(context)),
                              self.kv_latents(lat)], axis=1)
        keys, values = jnp.split(kv, 2, axis=-1)
        valid = jnp.concatenate([mask, jnp.ones((b, n), bool)], axis=1)

        def heads(x):
            return x.reshape(b, x.shape[1], h, k // h)

        scores = jnp.einsum("bnhd,bthd->bhnt", heads(self.q(lat)), heads(keys)) / math.sqrt(k // h)
        scores = jnp.where(valid[:, None, None, :], scores, -1e30)
        attended = jnp.einsum("bhnt,bthd->bnhd", jax.nn.softmax(scores, axis=-1), heads(values))
        latents = latents + self.post_attention_norm(self.out(attended.reshape(b, n, k)))
        mlp = self.mlp_out(jax.nn.silu(self.mlp_in(self.pre_mlp_norm(latents))))
        return latents + self.post_mlp_norm(mlp)


class PerceiverResampler(nnx.Module):
    """``n_latents`` learned queries and ``num_blocks`` :class:`PerceiverBlock` s: a sequence of
    any length ``[B, T, d]`` becomes ``[B, n_latents, d_latent]``.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> r = PerceiverResampler(8, 16, 3, 1, n_heads=2, rngs=nnx.Rngs(0))
        >>> r(jnp.ones((2, 5, 8)), jnp.ones((2, 5), bool)).shape
        (2, 3, 16)
    """

    def __init__(self, d_context: int, d_latent: int, n_latents: int, num_blocks: int, *,
                 n_heads: int = 4, rngs: nnx.Rngs):
        self.latents = nnx.Param(jax.random.normal(rngs.params(), (n_latents, d_latent)) * 0.02)
        self.blocks = nnx.List([PerceiverBlock(d_context, d_latent, n_heads, rngs=rngs)
                                for _ in range(num_blocks)])

    def __call__(self, context, mask):
        latents = jnp.broadcast_to(self.latents[...], (context.shape[0],) + self.latents.shape)
        for block in self.blocks:
            latents = block(latents, context, mask)
        return latents


class DocToLoRA(nnx.Module):
    """The hypernetwork: context features → per-chunk rank-``r`` adapters → :class:`LoRABank`.

    Parts (shapes for ``L`` layers): an encoder :class:`PerceiverResampler` shared by every
    layer, a one-block decoder resampler mapping its latents to ``rank`` codes, a per-layer
    residual MLP (``[L, k, 4k]``), L2 normalisation, a per-layer head ``[L, k, d_in + d_out]``,
    per-rank scalers ``σ_A [L, r, 1]`` (init 1) and ``σ_B`` (init **0**), and the bias LoRA
    ``A_bias ~ N(0, 0.2/√(d_in r))``, ``B_bias = 0``.

    Args:
        config: a :class:`DocToLoRAConfig`.
        rngs: ``nnx.Rngs`` for the initialisation.
    """

    def __init__(self, config: DocToLoRAConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        n_layers, k, r = len(c.layers), c.d_latent, c.rank
        self.encoder = PerceiverResampler(c.d_model, k, c.n_latents, c.num_blocks,
                                          n_heads=c.n_heads, rngs=rngs)
        self.decoder = PerceiverResampler(k, k, r, 1, n_heads=c.n_heads, rngs=rngs)
        self.pre_head_in = nnx.Param(
            jax.random.normal(rngs.params(), (n_layers, k, 4 * k)) / math.sqrt(k))
        self.pre_head_out = nnx.Param(jnp.zeros((n_layers, 4 * k, k)))
        std = 0.5 / math.sqrt(k + (c.d_in + c.d_out) * r)
        self.head = nnx.Param(
            jax.random.normal(rngs.params(), (n_layers, k, c.d_in + c.d_out)) * std)
        self.scale_a = nnx.Param(jnp.ones((n_layers, r, 1)))
        self.scale_b = nnx.Param(jnp.zeros((n_layers, r, 1)))
        self.bias_a = nnx.Param(
            jax.random.normal(rngs.params(), (n_layers, r, c.d_in)) * 0.2 / math.sqrt(c.d_in * r))
        self.bias_b = nnx.Param(jnp.zeros((n_layers, r, c.d_out)))

    @classmethod
    def for_model(cls, model, *, layers: Sequence[int], target: str = "down_proj",
                  rngs: nnx.Rngs, **options) -> "DocToLoRA":
        """A hypernetwork sized for ``model`` (a :class:`~lowrank_jax.models.Llama`)."""
        cfg = model.cfg
        bad = [i for i in layers if not 0 <= int(i) < cfg.n_layers]
        if bad:
            raise ValueError(f"layers={list(layers)}: {bad} are outside the model's "
                             f"{cfg.n_layers} decoder layers (0..{cfg.n_layers - 1}).")
        d_in, d_out = projection_shape(cfg, target)
        return cls(DocToLoRAConfig(layers=tuple(layers), d_model=cfg.d_model, d_in=d_in,
                                   d_out=d_out, target=target, **options), rngs=rngs)

    def generate_chunks(self, features, mask):
        """Per-chunk adapters: ``features [N, L, T, d]``, ``mask [N, T]`` →
        ``(a [N, L, r, d_in], b [N, L, r, d_out])`` (chunks with an all-false mask give 0)."""
        c = self.config
        n, n_layers, t, d = features.shape
        if n_layers != len(c.layers) or d != c.d_model:
            raise ValueError(f"features have shape {features.shape}; expected [chunks, "
                             f"{len(c.layers)}, T, {c.d_model}] (one sequence per target layer).")
        flat = features.reshape(n * n_layers, t, d).astype(jnp.float32)
        flat_mask = jnp.repeat(mask.astype(bool), n_layers, axis=0)
        latents = self.encoder(flat, flat_mask)
        codes = self.decoder(latents, jnp.ones(latents.shape[:2], bool))
        codes = codes.reshape(n, n_layers, c.rank, c.d_latent)
        hidden = jax.nn.silu(jnp.einsum("nlrk,lkm->nlrm", _layer_norm(codes),
                                        self.pre_head_in[...]))
        codes = codes + _layer_norm(jnp.einsum("nlrm,lmk->nlrk", hidden, self.pre_head_out[...]))
        codes = codes / (jnp.linalg.norm(codes, axis=-1, keepdims=True) + 1e-6)
        rows = jnp.einsum("nlrk,lke->nlre", codes, self.head[...])
        valid = mask.any(axis=-1).astype(jnp.float32)[:, None, None, None]
        a = rows[..., :c.d_in] * self.scale_a[...] * valid
        b = rows[..., c.d_in:] * self.scale_b[...] * valid
        return a, b

    def __call__(self, features, mask) -> LoRABank:
        """Merged adapters of ``D`` documents of up to ``C`` chunks each.

        Args:
            features: ``[D, C, L, T, d_model]`` context features (:func:`encode_chunks`).
            mask: ``[D, C, T]``; a chunk whose mask is all false is padding and adds zero ranks.

        Returns:
            A :class:`LoRABank` with ``R = (C + 1) · rank``: the chunks in order, then the bias.
        """
        c = self.config
        docs, chunks = mask.shape[:2]
        a, b = self.generate_chunks(features.reshape((-1,) + features.shape[2:]),
                                    mask.reshape((-1,) + mask.shape[2:]))
        n_layers = len(c.layers)

        def per_doc(x):  # [D*C, L, r, e] -> [D, L, C*r, e]
            x = x.reshape(docs, chunks, n_layers, c.rank, x.shape[-1])
            return x.transpose(0, 2, 1, 3, 4).reshape(docs, n_layers, chunks * c.rank, -1)

        bias_a = jnp.broadcast_to(self.bias_a[...] * c.bias_scaler, (docs,) + self.bias_a.shape)
        bias_b = jnp.broadcast_to(self.bias_b[...], (docs,) + self.bias_b.shape)
        return LoRABank(jnp.concatenate([per_doc(a), bias_a], axis=2),
                        jnp.concatenate([per_doc(b), bias_b], axis=2))


def projection_shape(cfg, target: str) -> tuple[int, int]:
    """``(d_in, d_out)`` of projection ``target`` in a model of config ``cfg``."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.d_model, q), "k_proj": (cfg.d_model, kv),
              "v_proj": (cfg.d_model, kv), "o_proj": (q, cfg.d_model),
              "gate_proj": (cfg.d_model, cfg.d_ff), "up_proj": (cfg.d_model, cfg.d_ff),
              "down_proj": (cfg.d_ff, cfg.d_model)}
    if target not in shapes:
        raise ValueError(f"target={target!r} is unknown; use one of {', '.join(shapes)}.")
    return shapes[target]


class _AdapterRecorder(Recorder):
    """Adds ``s · (x aᵀ) b`` (one adapter per batch row, or one for all) to tapped outputs."""

    def __init__(self, adapters: dict, scale: float):
        super().__init__(keep_inputs=False)
        self.adapters, self.scale = adapters, scale

    def __call__(self, path, x, y):
        y = super().__call__(path, x, y)
        if path not in self.adapters:
            return y
        a, b = self.adapters[path]  # [D, R, in], [D, R, out]
        if a.shape[0] == 1:
            a, b = a[0], b[0]
            delta = lora_output(x.astype(jnp.float32), a.T, b, 1.0)
        elif a.shape[0] == x.shape[0]:
            h = jnp.einsum("b...i,bri->b...r", x.astype(jnp.float32), a)
            delta = jnp.einsum("b...r,bro->b...o", h, b)
        else:
            raise ValueError(f"the adapter bank holds {a.shape[0]} documents but {path} sees a "
                             f"batch of {x.shape[0]}; give one document per batch row (or one "
                             "for all rows).")
        return (y.astype(jnp.float32) + self.scale * delta).astype(y.dtype)


@contextlib.contextmanager
def adapted(model, bank: LoRABank, config: DocToLoRAConfig):
    """Inside the block, ``model``'s targeted projections add the bank's adapters.

    Row ``i`` of the batch uses document ``i`` of ``bank`` (or document 0 for every row when the
    bank holds one). Works inside ``jax.jit`` / ``jax.grad`` (the bank may be traced).

    Example::

        >>> with adapted(model, bank, hyper.config):  # doctest: +SKIP
        ...     logits, _ = model(question_tokens)
    """
    if bank.a.shape[1] != len(config.layers):
        raise ValueError(f"bank has {bank.a.shape[1]} layers but config.layers="
                         f"{config.layers}; use the bank the same hypernetwork generated.")
    adapters = {path: (bank.a[:, i], bank.b[:, i]) for i, path in enumerate(config.paths)}
    with tapped(model, config.paths), recording(_AdapterRecorder(adapters, config.scale)):
        yield model


def chunk_document(tokens: Sequence[int], chunk_len: int, max_chunks: int | None = None):
    """Split a token list into ``[C, chunk_len]`` (last chunk zero-padded) and its mask.

    With ``max_chunks``, pad with all-false chunks to exactly that many (static shapes), or
    raise when the document needs more.
    """
    tokens = list(tokens)
    if not tokens:
        raise ValueError("the document is empty; give at least one token.")
    if not (isinstance(chunk_len, int) and chunk_len >= 1):
        raise ValueError(f"chunk_len={chunk_len!r} must be a positive integer.")
    n = -(-len(tokens) // chunk_len)
    total = n if max_chunks is None else max_chunks
    if n > total:
        raise ValueError(f"the document has {len(tokens)} tokens = {n} chunks of {chunk_len} but "
                         f"max_chunks={max_chunks}; raise max_chunks or chunk_len.")
    ids = np.zeros((total, chunk_len), np.int32)
    mask = np.zeros((total, chunk_len), bool)
    for c in range(n):
        part = tokens[c * chunk_len:(c + 1) * chunk_len]
        ids[c, :len(part)], mask[c, :len(part)] = part, True
    return ids, mask


def chunk_encoder(model, layers: Sequence[int]):
    """A jitted ``tokens [C, T] → features [C, L, T, d_model]``: the inputs of decoder
    ``layers`` while the frozen ``model`` reads each chunk (float32, no gradient). Compiled
    once per shape; reuse it for many documents."""
    graphdef, state = nnx.split(model)
    paths = [f"layers/{int(i)}" for i in layers]

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        with capture(model, paths) as rec:
            model(tokens)
        feats = jnp.stack([rec.inputs[p][0] for p in paths], axis=1)
        return jax.lax.stop_gradient(feats.astype(jnp.float32))

    return lambda tokens: run(state, jnp.asarray(tokens, jnp.int32))


def encode_chunks(model, tokens, layers: Sequence[int]):
    """Context features of ``tokens [C, T]`` (see :func:`chunk_encoder`), ``[C, L, T, d]``."""
    return chunk_encoder(model, layers)(tokens)


def internalizer(model, hyper: DocToLoRA, *, chunk_len: int = 256):
    """A jitted ``tokens → LoRABank`` (``D = 1``) for many documents: chunk, encode with the
    frozen ``model``, generate. Uses the weights ``model`` and ``hyper`` have *now*; each number
    of chunks compiles once."""
    encode = chunk_encoder(model, hyper.config.layers)
    graphdef, state = nnx.split(hyper)

    @jax.jit
    def generate(state, features, mask):
        return nnx.merge(graphdef, state)(features, mask)

    def run(tokens: Sequence[int]) -> LoRABank:
        ids, mask = chunk_document(tokens, chunk_len)
        return LoRABank(*generate(state, encode(ids)[None], jnp.asarray(mask)[None]))

    return run


def internalize(model, hyper: DocToLoRA, tokens: Sequence[int], *, chunk_len: int = 256
                ) -> LoRABank:
    """One document's adapter (``D = 1``): chunk, encode with the frozen ``model``, generate.

    Pure (no state changes), so it is cached once and reused for every question; for many
    documents build :func:`internalizer` once.
    """
    return internalizer(model, hyper, chunk_len=chunk_len)(tokens)


def bank_delta(bank: LoRABank, config: DocToLoRAConfig, doc: int = 0):
    """Dense updates ``s · Aᵀ B`` ``[L, d_in, d_out]`` of document ``doc`` (for checks)."""
    return config.scale * jnp.einsum("lri,lro->lio", bank.a[doc], bank.b[doc])


__all__ = ["DocToLoRA", "DocToLoRAConfig", "LoRABank", "PerceiverBlock", "PerceiverResampler",
           "adapted", "bank_delta", "chunk_encoder", "chunk_document", "default_alpha",
           "encode_chunks", "internalize", "internalizer", "projection_shape", "target_path"]
