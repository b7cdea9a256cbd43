"""xKV evaluation: the perplexity protocol shared by xKV, per-layer SVD and the exact cache
(teacher-forced blocks after a rebuilt context, through the one Llama forward), and the object
``--kv xkv`` builds for the CLI."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.kv.cache import SelectiveConfig, XKVCache
from lowrank_jax.kv.compress import SVDCache
from lowrank_jax.kv.model import ContextKV, prefill_kv, xkv_decode_step, xkv_generate, xkv_prefill
from lowrank_jax.kv.methods import (
    cache_ratio,
    compress_kv,
    get_method,
    kv_generate,
    reconstruct_all,
)
from lowrank_jax.kv.ranks import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SINK_TOKENS,
    DEFAULT_VALUE_RANK_SCALE,
)
from pallas_kernels.xkv_decode.reference import rope


@nnx.jit
def _block_logits(model, tokens, context_keys, context_values):
    return model(tokens, cache=ContextKV(context_keys, context_values))[0]


@functools.partial(jax.jit, static_argnums=(1,))
def _rotate_context(keys, theta: float):
    positions = jnp.arange(keys.shape[2])
    return jax.vmap(lambda k: rope(k, positions, theta))(keys)


@jax.jit
def _relative_error(approx, exact):
    return jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact)


def _setting(setting, group_size: int, sink_tokens: int, value_rank_scale: float) -> dict:
    """A sweep setting (tuple or dict) as ``dict(method=, ratio=, options...)``."""
    if isinstance(setting, dict):
        out = dict(setting)
    else:
        out = dict(method=setting[0], ratio=setting[1])
        if len(setting) > 2:
            out["sink_tokens"] = int(setting[2])
        if len(setting) > 3:
            out["group_size"] = int(setting[3])
    method = out.get("method")
    get_method(method)
    if method in ("xkv", "per_layer_svd"):
        out.setdefault("sink_tokens", sink_tokens)
        out.setdefault("group_size", group_size)
        out.setdefault("value_rank_scale", value_rank_scale)
        if method == "per_layer_svd":
            out["group_size"] = 1
    elif method.startswith(("xkv_quant", "xkv_mixed")):
        out.setdefault("sink_tokens", sink_tokens)
        out.setdefault("group_size", group_size)
    return out


def xkv_perplexity_sweep(
    model, ids, *, context_len: int, eval_len: int, settings: Sequence[tuple],
    group_size: int = DEFAULT_GROUP_SIZE, value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    sink_tokens: int = DEFAULT_SINK_TOKENS, prefill=None, svd_cache: SVDCache | None = None,
) -> list[dict]:
    """Perplexity of ``eval_len`` tokens after a compressed ``context_len`` context, per setting.

    Protocol (identical for every method): prefill ``ids[:, :C]`` exactly, compress its KV cache
    (``"none"`` keeps it exact), then score ``ids[:, C+1 : C+E+1]`` from inputs
    ``ids[:, C : C+E]`` in one teacher-forced block whose queries attend to the (rebuilt,
    re-rotated) context plus the exact new tokens, which is what token-by-token decoding with an
    exact tail computes. The prefill is shared by all settings.

    Args:
        model: a Llama.
        ids: ``[T]`` or ``[b, T]`` token ids with ``T >= context_len + eval_len + 1``.
        context_len, eval_len: ``C`` and ``E``.
        settings: ``(method, ratio[, sink_tokens[, group_size]])`` tuples or
            ``dict(method=, ratio=, **options)`` (options go to the method's compress), method
            in :data:`~lowrank_jax.kv.methods.KV_METHODS` (``ratio`` ignored for ``"none"``;
            omitted entries take the keyword defaults below). Every method stores 16-bit
            floats; ``compression_ratio`` is against the exact fp16 cache.
        group_size: ``G`` for ``"xkv"``.
        value_rank_scale: ``r_v / r_k``.
        sink_tokens: exact leading tokens for settings that do not give their own.
        prefill: optional ``(keys, values)`` of :func:`~lowrank_jax.kv.model.prefill_kv` on
            ``ids[:, :context_len]``, to share one window's prefill across calls (checked
            against the expected shape; the caller guarantees it is that window's).
        svd_cache: an :class:`~lowrank_jax.kv.compress.SVDCache` to share the exact group
            SVDs of this prefill with other calls (default: a fresh one per call, shared by
            its settings); only xKV-family settings with the exact SVD use it.

    Returns:
        One dict per setting: ``method, target_ratio, sink_tokens, group_size, options,
        compression_ratio, rank_k, rank_v (first group), ranks (every group), bits (KIVI),
        key_error, value_error`` (relative Frobenius error of the pre-RoPE
        context K / V over all layers) ``, nll, perplexity, tokens``.
    """
    ids = jnp.asarray(ids)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[1] < context_len + eval_len + 1:
        raise ValueError(
            f"ids has shape {ids.shape}; need [batch, >= context_len + eval_len + 1 = "
            f"{context_len + eval_len + 1}] tokens."
        )
    if context_len < 1 or eval_len < 1:
        raise ValueError(f"context_len={context_len} and eval_len={eval_len} must be >= 1.")
    theta = model.cfg.rope_theta
    if prefill is None:
        keys, values = prefill_kv(model, ids[:, :context_len])
    else:
        keys, values = prefill
        if keys.shape != values.shape or keys.shape[1:3] != (ids.shape[0], context_len):
            raise ValueError(
                f"prefill= has keys {keys.shape} / values {values.shape}; expected "
                f"[layers, {ids.shape[0]}, {context_len}, kv_heads, head_dim] for both (the "
                "output of prefill_kv(model, ids[:, :context_len])).")
    inputs = ids[:, context_len: context_len + eval_len]
    targets = ids[:, context_len + 1: context_len + eval_len + 1]
    svd_cache = SVDCache() if svd_cache is None else svd_cache
    results = []
    rel = lambda a, b: float(_relative_error(a, b))  # noqa: E731
    for setting in settings:
        options = _setting(setting, group_size, sink_tokens, value_rank_scale)
        method, ratio = options.pop("method"), options.pop("ratio", None)
        extra = {}
        if (method in ("xkv", "per_layer_svd")
                or method.startswith(("xkv_quant", "xkv_mixed"))) and \
                options.get("svd_method", "full") == "full" and "selective" not in options:
            extra["svd_cache"] = svd_cache
        cache = compress_kv(method, keys, values, rope_theta=theta, ratio=ratio, **options,
                            **extra)
        ctx_k, ctx_v = reconstruct_all(method, cache)
        ranks = getattr(cache, "ranks", None)
        info = dict(compression_ratio=cache_ratio(cache),
                    rank_k=ranks[0][0] if ranks else None, rank_v=ranks[0][1] if ranks else None,
                    ranks=[list(r) for r in ranks] if ranks else None,
                    bits=getattr(cache, "bits", None),
                    key_error=rel(ctx_k, keys), value_error=rel(ctx_v, values))
        ctx_k = _rotate_context(ctx_k, float(theta))
        logits = _block_logits(model, inputs, ctx_k, ctx_v.astype(jnp.float32))
        nll = float(cross_entropy(logits, targets))
        results.append(dict(method=method, target_ratio=None if method == "none" else ratio,
                            sink_tokens=options.get("sink_tokens"),
                            group_size=options.get("group_size"), options=options, nll=nll,
                            perplexity=math.exp(nll), tokens=int(targets.size), **info))
    return results


def xkv_perplexity(
    model, ids, *, context_len: int, eval_len: int, ratio: float = 8.0, method: str = "xkv",
    group_size: int = DEFAULT_GROUP_SIZE, value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
) -> float:
    """Perplexity of ``eval_len`` tokens after a compressed context (see
    :func:`xkv_perplexity_sweep` for the protocol, shared by ``"xkv"``, ``"per_layer_svd"``
    (same ``ratio``, ``G = 1``, so equal memory up to rank rounding) and ``"none"``).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
        ...                           n_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
        >>> ids = jnp.arange(64) % 32
        >>> ppl = xkv_perplexity(model, ids, context_len=48, eval_len=8, ratio=2.0,
        ...                      group_size=2)
        >>> ppl > 1.0
        True
    """
    return xkv_perplexity_sweep(model, ids, context_len=context_len, eval_len=eval_len,
                                settings=[(method, ratio)], group_size=group_size,
                                value_rank_scale=value_rank_scale,
                                sink_tokens=sink_tokens)[0]["perplexity"]


def xkv_windowed_perplexity(model, ids, factory, *, window: int, eval_len: int,
                            progress: bool = True) -> tuple[float, int]:
    """Perplexity over disjoint windows of ``window`` tokens of ``ids``: in each, prefill and
    compress the first ``window - eval_len - 1`` tokens with ``factory``'s settings and score the
    last ``eval_len`` (geometric mean over windows). Returns ``(perplexity, windows)``."""
    from tqdm.auto import tqdm

    if not 0 < eval_len < window - 1:
        raise ValueError(f"eval_len={eval_len} must lie in [1, window-2={window - 2}].")
    n_windows = len(ids) // window
    if n_windows == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}.")
    logs = []
    for w in tqdm(range(n_windows), desc="xkv eval", disable=not progress):
        chunk = ids[w * window:(w + 1) * window]
        ppl = factory.perplexity(model, chunk, context_len=window - eval_len - 1,
                                 eval_len=eval_len)
        logs.append(math.log(ppl))
    return math.exp(sum(logs) / len(logs)), n_windows


# --------------------------------------------------------------------------------------------
# CLI hook
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class XKVCacheFactory:
    """What ``--kv xkv --kv-ratio R [--kv-group G]`` builds: bound settings for a model.

    Example::

        >>> factory = xkv_cache_factory(8.0, 4)
        >>> factory.ratio, factory.group_size
        (8.0, 4)
    """

    ratio: float
    group_size: int = DEFAULT_GROUP_SIZE
    value_rank_scale: float = DEFAULT_VALUE_RANK_SCALE
    selective: SelectiveConfig | None = None
    sink_tokens: int = DEFAULT_SINK_TOKENS

    def prefill(self, model, tokens, *, max_new_tokens: int = 256) -> XKVCache:
        return xkv_prefill(model, tokens, ratio=self.ratio, group_size=self.group_size,
                           value_rank_scale=self.value_rank_scale, selective=self.selective,
                           max_new_tokens=max_new_tokens, sink_tokens=self.sink_tokens)

    def decode_step(self, model, cache: XKVCache, token):
        return xkv_decode_step(model, cache, token)

    def generate(self, model, prompt, *, max_new_tokens: int):
        return xkv_generate(model, prompt, max_new_tokens=max_new_tokens, ratio=self.ratio,
                            group_size=self.group_size, value_rank_scale=self.value_rank_scale,
                            selective=self.selective, sink_tokens=self.sink_tokens)

    def perplexity(self, model, ids, *, context_len: int, eval_len: int) -> float:
        return xkv_perplexity(model, ids, context_len=context_len, eval_len=eval_len,
                              ratio=self.ratio, group_size=self.group_size,
                              value_rank_scale=self.value_rank_scale,
                              sink_tokens=self.sink_tokens)


def xkv_cache_factory(ratio: float, group_size: int = DEFAULT_GROUP_SIZE,
                      sink_tokens: int = DEFAULT_SINK_TOKENS) -> XKVCacheFactory:
    """The object ``--kv xkv --kv-ratio R --kv-group G --kv-sink S`` maps to (validated).

    Example::

        >>> xkv_cache_factory(4.0).group_size
        4
    """
    if not ratio > 0:
        raise ValueError(f"ratio={ratio} must be > 0 (e.g. 8).")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (default 4).")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens={sink_tokens!r} must be an int >= 0 (default "
                         f"{DEFAULT_SINK_TOKENS}; 0 = the paper's xKV).")
    return XKVCacheFactory(ratio=float(ratio), group_size=group_size, sink_tokens=sink_tokens)


@dataclasses.dataclass(frozen=True)
class KVCacheFactory:
    """What ``--kv METHOD --kv-ratio R [--kv-group G --kv-sink S]`` builds, for any method of
    :data:`~lowrank_jax.kv.methods.KV_METHODS` (``group_size`` is used by the xKV family,
    ``sink_tokens`` by every compressed method).

    Example::

        >>> kv_cache_factory("kivi", 4.0).options()
        {'sink_tokens': 1}
    """

    method: str
    ratio: float | None
    group_size: int = DEFAULT_GROUP_SIZE
    sink_tokens: int = DEFAULT_SINK_TOKENS

    def options(self) -> dict:
        if self.method == "none":
            return {}
        out = dict(sink_tokens=self.sink_tokens)
        if self.method == "xkv" or self.method.startswith(("xkv_quant", "xkv_mixed")):
            out["group_size"] = self.group_size
        return out

    def describe(self) -> str:
        if self.method == "none":
            return "exact cache"
        extra = (f", groups of {self.group_size} layers" if "group_size" in self.options()
                 else "")
        return (f"{self.method} cache: target ratio {self.ratio:g}x of the fp16 cache, all bytes "
                f"counted{extra}, {self.sink_tokens} exact sink token(s)")

    def generate(self, model, prompt, *, max_new_tokens: int):
        return kv_generate(model, prompt, method=self.method, ratio=self.ratio,
                           max_new_tokens=max_new_tokens, **self.options())

    def perplexity(self, model, ids, *, context_len: int, eval_len: int) -> float:
        setting = dict(method=self.method, ratio=self.ratio, **self.options())
        return xkv_perplexity_sweep(model, ids, context_len=context_len, eval_len=eval_len,
                                    settings=[setting])[0]["perplexity"]


def kv_cache_factory(method: str, ratio: float | None = 8.0,
                     group_size: int = DEFAULT_GROUP_SIZE,
                     sink_tokens: int = DEFAULT_SINK_TOKENS) -> KVCacheFactory:
    """The validated object ``--kv METHOD --kv-ratio R --kv-group G --kv-sink S`` maps to."""
    get_method(method)
    if method != "none" and not (ratio is not None and ratio > 0):
        raise ValueError(f"ratio={ratio} must be > 0 (e.g. 8).")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (default 4).")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens={sink_tokens!r} must be an int >= 0.")
    return KVCacheFactory(method, None if ratio is None else float(ratio), group_size,
                          sink_tokens)


def generate_text_with_kv(model, tokenizer, prompt: str, factory: KVCacheFactory, *,
                          max_new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` (a string) decoded from ``factory``'s compressed cache,
    cut at the end token (what ``generate --kv METHOD`` prints)."""
    ids = tokenizer.encode(prompt)
    if len(ids) + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"max_new_tokens={max_new_tokens} + {len(ids)} prompt tokens exceed "
                         f"the model's context ({model.cfg.max_seq_len}); lower it.")
    out = [int(t) for t in factory.generate(model, jnp.asarray([ids], jnp.int32),
                                            max_new_tokens=max_new_tokens)[0]]
    if tokenizer.eos_id in out:
        out = out[: out.index(tokenizer.eos_id)]
    return tokenizer.decode(out)


def parse_setting(text: str) -> dict:
    """A sweep setting written ``method:ratio[:key=value,...]`` as ``dict(method=, ratio=, ...)``.

    Values become ``int``, ``float`` or ``bool`` (``True`` / ``False``) when they read as one.

    Example::

        >>> parse_setting("xkv_quant:8:factor_bits=4,hadamard=True")
        {'method': 'xkv_quant', 'ratio': 8.0, 'factor_bits': 4, 'hadamard': True}
    """
    parts = text.split(":")
    setting = dict(method=parts[0], ratio=float(parts[1]))
    if len(parts) > 2 and parts[2]:
        for item in parts[2].split(","):
            key, value = item.split("=")
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    continue
            if value in ("True", "False"):
                value = value == "True"
            setting[key] = value
    return setting


def summarize_sweep(labelled: Sequence[tuple[str, dict]], records: Sequence[dict]) -> list[dict]:
    """One row per ``(label, setting)`` from the per-window records of a sweep.

    ``records`` are :func:`xkv_perplexity_sweep` records with ``label`` and ``window`` added (or
    ``{"label", "target_ratio", "window", "method", "unreachable": reason}`` for a setting that
    cannot reach its ratio). A row has the perplexity ``exp(mean NLL)`` over its windows, the
    smallest compression ratio reached, the mean key / value errors, the per-window perplexities
    and ``vs_exact``: its perplexity over the exact cache's on the same windows, minus 1 (the
    exact row, method ``"none"``, must come first for it; ``None`` otherwise).
    """
    rows = []
    exact = None
    for label, setting in labelled:
        sel = [r for r in records if r["label"] == label and r["target_ratio"] == setting["ratio"]]
        if any("unreachable" in r for r in sel):
            rows.append(dict(label=label, method=setting["method"], target=setting["ratio"],
                             unreachable=sel[0]["unreachable"]))
            continue
        ppl = math.exp(float(np.mean([r["nll"] for r in sel])))
        if setting["method"] == "none":
            exact = {r["window"]: r["nll"] for r in sel}
        # the exact cache on the same windows (an interrupted row may have fewer)
        base = None if exact is None else math.exp(float(np.mean([exact[r["window"]]
                                                                   for r in sel])))
        rows.append(dict(
            label=label, method=setting["method"], target=setting["ratio"],
            actual=float(np.min([r["compression_ratio"] for r in sel])), perplexity=ppl,
            vs_exact=None if base is None else ppl / base - 1.0,
            key_error=float(np.mean([r["key_error"] for r in sel])),
            value_error=float(np.mean([r["value_error"] for r in sel])),
            windows=[r["perplexity"] for r in sel], ranks=sel[0].get("ranks"),
            options=sel[0].get("options")))
    return rows


__all__ = [
    "KVCacheFactory", "XKVCacheFactory", "generate_text_with_kv", "kv_cache_factory",
    "parse_setting", "summarize_sweep", "xkv_cache_factory", "xkv_perplexity",
    "xkv_perplexity_sweep",
    "xkv_windowed_perplexity",
]
