"""Text generation with the KV cache, and sliding-window perplexity.

Both functions take any :class:`~lowrank_jax.models.llama.Llama` (dense, factorized, LoRA) and
compile their model calls once: the model is split into a static graph and a parameter state, and
module-level ``jax.jit`` functions take the graph as a static argument, so a second call with the
same model shape (and the same prompt length) does not recompile, and a decode step never
retraces per token.

Sampling: ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the
temperature and nucleus (top-p) sampling keeps the smallest set of tokens whose probability mass
reaches ``top_p``:

.. math:: V_p = \\min\\{V : \\textstyle\\sum_{v \\in V} p(v) \\ge p\\}, \\qquad
          x \\sim p(\\cdot)\\,\\mathbb{1}[x \\in V_p] / \\textstyle\\sum_{V_p} p

References:
    Holtzman et al, `The Curious Case of Neural Text Degeneration
    <https://arxiv.org/abs/1904.09751>`_, 2019 (top-p sampling).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.core.losses import PerplexityResult, window_nll_sum, windowed_perplexity
from lowrank_jax.models.llama import (KVCache, Llama, ScannedLayers, decoder_forward,
                                      embedding_scale, lm_logits)

CacheFactory = Callable[..., Any]  # (cfg, batch, max_len) -> a cache the model accepts


class GenerationResult(NamedTuple):
    """Output of :func:`generate`."""

    token_ids: list[int]  # the new tokens only (eos included when it stopped there)
    text: str | None  # their decoded text (None without a tokenizer)
    stopped_at_eos: bool
    logits: np.ndarray | None  # [new_tokens, vocab] fp32 when return_logits=True


class _Static:
    """How to run a model inside ``jax.jit``: its graph(s), as a hashable static argument.

    ``nnx.GraphDef`` is not hashable when a module holds a mutable dataclass (our
    ``LlamaConfig``) but compares by value, so we hash by sizes and compare with ``==``: one
    compilation per distinct model structure.

    ``mode="scan"`` (all decoder layers share one structure, the usual case): the layers'
    parameters are stacked and run under ``jax.lax.scan``, so XLA compiles one layer instead
    of ``n_layers`` unrolled copies (DERIVED: compile time of SmolLM2's 30 layers drops from tens
    of seconds to a few on CPU; same math as ``Llama.__call__``, checked in the tests).
    ``mode="full"``: the model's own ``__call__``.
    """

    def __init__(self, mode: str, graphs: tuple, dtype: str, embed_scale=None, softcap=None):
        self.mode, self.graphs, self.dtype = mode, graphs, dtype
        self.embed_scale, self.softcap = embed_scale, softcap
        self._hash = hash((mode, dtype, embed_scale, softcap) + tuple(
            None if g is None else (len(g.nodes), g.num_leaves) for g in graphs))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (
            isinstance(other, _Static) and self.mode == other.mode and self.dtype == other.dtype
            and self.embed_scale == other.embed_scale and self.softcap == other.softcap
            and len(self.graphs) == len(other.graphs)
            and all(a == b for a, b in zip(self.graphs, other.graphs))
        )


def prepare(model: Llama, *, scan_layers: bool = True):
    """``(static, state)`` for the jitted runners: the model split once, layers stacked.

    Args:
        model: the decoder.
        scan_layers: stack the layers and ``scan`` over them when they share one structure
            (not when they differ: per-layer attention names, or ``layer_types`` mixing
            sliding-window and full layers, e.g. Gemma 2/3 — those run unrolled).

    Returns:
        A hashable ``static`` (pass as the static argument) and a ``state`` pytree.
    """
    layers = list(model.layers)
    # per-layer attention implementations (a tuple in cfg.attention) or layer types (windows,
    # RoPE bases) cannot share one scan body: such models run unrolled
    if scan_layers and layers and model.cfg.uniform_layers:
        splits = [nnx.split(layer) for layer in layers]
        graph0 = splits[0][0]
        if all(g == graph0 for g, _ in splits[1:]):
            embed_graph, embed_state = nnx.split(model.embed_tokens)
            norm_graph, norm_state = nnx.split(model.norm)
            if model.lm_head is None:
                head_graph, head_state = None, None
            else:
                head_graph, head_state = nnx.split(model.lm_head)
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[st for _, st in splits])
            static = _Static("scan", (embed_graph, graph0, norm_graph, head_graph),
                             str(model.cfg.dtype), embedding_scale(model.cfg),
                             model.cfg.final_logit_softcap)
            return static, {"embed": embed_state, "layers": stacked, "norm": norm_state,
                            "head": head_state}
    graph, state = nnx.split(model)
    return _Static("full", (graph,), str(model.cfg.dtype)), state


def forward(static: _Static, state, tokens, cache=None):
    """Logits ``[b, t, vocab]`` (fp32) and the advanced cache; traceable (call inside jit).

    ``cache`` is ``None``, a :class:`KVCache` or any :class:`~lowrank_jax.models.llama.KVProvider`
    (a provider that is not ``scannable`` needs ``prepare(model, scan_layers=False)``).
    """
    if static.mode == "full":
        model = nnx.merge(static.graphs[0], state)
        return model(tokens, cache=cache)
    embed_graph, layer_graph, norm_graph, head_graph = static.graphs
    embed = nnx.merge(embed_graph, state["embed"])
    x, cache = decoder_forward(
        embed, ScannedLayers(layer_graph, state["layers"]), nnx.merge(norm_graph, state["norm"]),
        tokens, cache=cache, dtype=static.dtype, embed_scale=static.embed_scale,
    )
    head = None if head_graph is None else nnx.merge(head_graph, state["head"])
    return lm_logits(x, embed, head, static.softcap), cache


def _default_cache(cfg, batch: int, max_len: int) -> KVCache:
    return KVCache.empty(cfg, batch, max_len)



@functools.partial(jax.jit, static_argnums=0)
def _prefill(static, state, tokens, cache):
    logits, cache = forward(static, state, tokens, cache)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=0)
def decode_step(static, state, token, cache):
    """One jitted decode step: ``(logits [batch, vocab], cache)`` of the last position after
    ``token [batch, t]`` is appended to ``cache`` (``static, state`` from :func:`prepare`).

    The cache is not donated (a custom cache may be read again after the step); generate's own
    :class:`KVCache` loop uses a donating twin of this step."""
    logits, cache = forward(static, state, token, cache)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _decode_step_in_place(static, state, token, cache):
    """:func:`decode_step` for generate's own :class:`KVCache`: its buffers are donated, so
    each token updates the cache in place instead of copying all of it (DERIVED: the copy is
    O(layers · context) bytes per token)."""
    logits, cache = forward(static, state, token, cache)
    return logits[:, -1], cache


# ``generate(unroll_decode=None)`` unrolls the decode layers from this many new tokens on: the
# unrolled step saves about 25-45 ms per SmolLM2 token on 2 CPU cores but its first compilation
# takes about 10-20 s longer (MEASURED round 4, loaded machine), so it pays off near 300 tokens.
UNROLL_MIN_NEW_TOKENS = 256


@jax.jit
def sample_token(logits, key, temperature, top_p):
    """The next token ``[batch]`` from ``logits [batch, vocab]``: greedy (the argmax) when
    ``temperature == 0``, else top-p (nucleus) sampling from ``softmax(logits / temperature)``
    over the smallest set of tokens whose probability reaches ``top_p``.

    A ``lax.cond``, so greedy decoding runs only the argmax: the top-p branch sorts the whole
    vocabulary (MEASURED: 18–33 ms per token for SmolLM2's 49152 logits on 2 cores, against
    0.4 ms for the argmax, when both were computed and one selected)."""

    def sampled():
        scaled = logits / jnp.maximum(temperature, 1e-6)
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p  # always keeps the top token
        choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
        return jnp.take_along_axis(order, choice[..., None], axis=-1)[..., 0]

    return jax.lax.cond(temperature > 0, sampled, lambda: jnp.argmax(logits, axis=-1))


def _stepwise(static, state, logits, cache, key, temperature, top_p, max_new_tokens,
              step_fn, tokenizer, stream, return_logits, stop_at_eos, eos_set):
    """One jitted decode step per token from Python: for ``stream`` (every token on the host)
    and for custom caches (whose structure may change between steps)."""
    new_ids: list[int] = []
    kept_logits = []
    emitted = ""
    for step in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token = int(sample_token(logits, sub, temperature, top_p)[0])
        if return_logits:
            kept_logits.append(np.asarray(logits[0]))
        new_ids.append(token)
        if stream is not None:
            piece = ""
            if tokenizer is not None:
                text = tokenizer.decode(new_ids)
                if not text.endswith("\ufffd"):
                    piece, emitted = text[len(emitted):], text
            stream(token, piece)
        if stop_at_eos and token in eos_set:
            return new_ids, kept_logits, True
        if step + 1 < max_new_tokens:
            logits, cache = step_fn(static, state, jnp.asarray([[token]], jnp.int32), cache)
    return new_ids, kept_logits, False


@functools.partial(jax.jit, static_argnums=(0, 8, 9), donate_argnums=3)
def _decode_loop(static, state, logits, cache, key, temperature, top_p, stops, n, keep):
    """Tokens ``[n]``, how many were made, their logits, and the cache: the greedy / top-p
    decode loop as one ``lax.while_loop`` (same key splits and steps as :func:`_stepwise`)."""
    vocab = logits.shape[-1]

    def sample(logits, key, i, buf, kept):
        key, sub = jax.random.split(key)
        token = sample_token(logits, sub, temperature, top_p)[0].astype(jnp.int32)
        if keep:
            kept = kept.at[i].set(logits[0])
        return key, token, buf.at[i].set(token), kept, jnp.any(token == stops)

    buf = jnp.zeros((n,), jnp.int32)
    kept = jnp.zeros((n if keep else 0, vocab), jnp.float32)
    key, token, buf, kept, done = sample(logits, key, 0, buf, kept)

    def cond(carry):
        return (carry[0] < n) & ~carry[-1]

    def body(carry):
        i, token, cache, key, buf, kept, _ = carry
        logits, cache = forward(static, state, token.reshape(1, 1), cache)
        key, token, buf, kept, done = sample(logits[:, -1], key, i, buf, kept)
        return i + 1, token, cache, key, buf, kept, done

    i, _, cache, _, buf, kept, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), token, cache, key, buf, kept, done))
    return buf, i, kept, cache


def _as_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is a str but tokenizer=None; pass a tokenizer or token ids.")
        return tokenizer.encode(prompt)
    ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
    return ids


def generate(
    model: Llama,
    tokenizer: Any,
    prompt: str | Sequence[int] | Int[Array, " t"],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    stop_at_eos: bool = True,
    eos_ids: Sequence[int] | None = None,
    stream: Callable[[int, str], None] | None = None,
    return_logits: bool = False,
    cache_factory: CacheFactory | None = None,
    unroll_decode: bool | None = None,
) -> GenerationResult:
    """Continue ``prompt`` token by token with the KV cache.

    One jitted prefill over the prompt fills the cache; then the whole decode loop runs as one
    compiled ``lax.while_loop`` with the KV cache donated (updated in place): no per-token
    Python dispatch. With ``stream`` the tokens must reach the host one by one, so one jitted
    decode step runs per token instead (same tokens: same key splits, same steps).

    The prefill scans the stacked layers (fast to compile); for long generations the decode
    steps run the layers unrolled (``unroll_decode``), so every matmul reads its weights where
    they lie. Under ``scan`` XLA:CPU copies
    each layer's slice of every stacked weight before its dot, so a scanned decode step moves
    about 3× the weight bytes (DERIVED from its optimized HLO; MEASURED 1.55–2.1× slower per
    SmolLM2-135M token, ``docs/results/bench.md``); the price is a longer first compilation
    (about 20 s for SmolLM2's 30 layers on 2 cores).

    Args:
        model: the decoder.
        tokenizer: anything with ``encode``/``decode``/``eos_id`` (or ``None`` with token ids).
        prompt: text (needs a tokenizer) or token ids.
        max_new_tokens: how many tokens to add at most (clipped to the context length).
        temperature: 0 for greedy decoding; > 0 samples with top-p.
        top_p: nucleus mass in ``(0, 1]``.
        key: PRNG key for sampling (default ``jax.random.key(0)``).
        stop_at_eos: stop after emitting an end token.
        eos_ids: end tokens (default: the tokenizer's ``stop_ids`` — its ``eos_id`` and the
            chat template's end-of-turn tokens — or its ``eos_id``).
        stream: called as ``stream(token_id, new_text)`` after every token (``new_text`` is the
            newly completed text, possibly empty while a multi-byte character is incomplete).
        return_logits: keep the fp32 logits that chose each new token.
        cache_factory: ``(cfg, batch, max_len) -> cache``; default an empty :class:`KVCache`
            (hook for compressed caches such as xKV).
        unroll_decode: decode with the layers unrolled (``True``) or scanned like the prefill
            (``False``: compiles faster, decodes slower on CPU; same tokens). ``None``
            (default): unrolled when ``max_new_tokens >= UNROLL_MIN_NEW_TOKENS`` (256), where
            the per-token saving outweighs the longer first compilation.

    Returns:
        A :class:`GenerationResult`.

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
        ...                   d_ff=32)
        >>> out = generate(Llama(cfg, rngs=nnx.Rngs(0)), None, [1, 2, 3], max_new_tokens=4)
        >>> len(out.token_ids)
        4
    """
    cfg = model.cfg
    ids = _as_ids(tokenizer, prompt)
    if not ids:
        raise ValueError("prompt is empty; give at least one token.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must lie in (0, 1].")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy).")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    if len(ids) >= cfg.max_seq_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens but the model's context is {cfg.max_seq_len}; "
            "shorten the prompt."
        )
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:4]} are outside [0, {cfg.vocab_size}).")
    max_new_tokens = min(max_new_tokens, cfg.max_seq_len - len(ids))
    if eos_ids is None:  # the end token, and the chat template's end-of-turn tokens
        eos = getattr(tokenizer, "eos_id", None)
        eos_ids = getattr(tokenizer, "stop_ids", None) or (() if eos is None else (eos,))
    eos_set = set(int(i) for i in eos_ids)
    key = jax.random.key(0) if key is None else key

    static, state = prepare(model, scan_layers=cache_factory is None)
    make_cache = cache_factory or _default_cache
    cache = make_cache(cfg, 1, len(ids) + max_new_tokens)
    logits, cache = _prefill(static, state, jnp.asarray([ids], jnp.int32), cache)
    if unroll_decode is None:
        unroll_decode = max_new_tokens >= UNROLL_MIN_NEW_TOKENS
    if unroll_decode and static.mode == "scan":  # decode reads each layer's weights in place
        static, state = prepare(model, scan_layers=False)
    step_fn = decode_step if cache_factory else _decode_step_in_place  # ours: donate it
    temperature_arr = jnp.float32(temperature)
    top_p_arr = jnp.float32(top_p)

    if stream is None and cache_factory is None:  # one compiled loop, no per-token host work
        stops = sorted(eos_set) if stop_at_eos else []
        buf, count, kept, _ = _decode_loop(
            static, state, logits, cache, key, temperature_arr, top_p_arr,
            jnp.asarray(stops or [-1], jnp.int32), max_new_tokens, return_logits)
        new_ids = [int(i) for i in np.asarray(buf[:int(count)])]
        stopped = bool(stop_at_eos and new_ids[-1] in eos_set)
        kept_logits = list(np.asarray(kept[:len(new_ids)])) if return_logits else []
    else:
        new_ids, kept_logits, stopped = _stepwise(
            static, state, logits, cache, key, temperature_arr, top_p_arr, max_new_tokens,
            step_fn, tokenizer, stream, return_logits, stop_at_eos, eos_set)
    text = tokenizer.decode(new_ids) if tokenizer is not None else None
    return GenerationResult(
        new_ids, text, stopped, np.stack(kept_logits) if return_logits else None
    )


@functools.partial(jax.jit, static_argnums=0)
def _window_nll(static, state, tokens, lo, hi, cache):
    """Summed NLL of targets ``tokens[r]`` for ``lo <= r < hi`` (r = position in the window)."""
    logits, _ = forward(static, state, tokens, cache)
    return window_nll_sum(logits, tokens, lo, hi)


def perplexity(
    model: Llama,
    token_ids: Sequence[int] | Int[Array, " n"],
    *,
    window: int = 1024,
    stride: int | None = None,
    progress: bool = True,
    cache_factory: CacheFactory | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of a token sequence.

    Windows of ``window`` tokens start every ``stride`` tokens; each token is scored once, in
    the first window that covers it with context (HF's recipe), so with ``stride < window``
    every scored token after the first window sees at least ``window - stride`` tokens of
    context. The very first token is never scored.

    .. math:: \\mathrm{PPL} = \\exp\\Big(-\\frac{1}{N}\\sum_{t} \\log p(x_t \\mid x_{<t})\\Big)

    Args:
        model: the decoder.
        token_ids: the sequence (at least 2 tokens).
        window: tokens per forward pass (at most the model's context).
        stride: step between window starts (default ``window``: disjoint windows).
        progress: show a tqdm bar over windows.
        cache_factory: when given, each window runs through ``model(tokens, cache=...)`` with a
            fresh cache from ``cache_factory(cfg, 1, window)`` (hook for compressed caches).

    Returns:
        A :class:`PerplexityResult` (perplexity, mean NLL, scored tokens, windows).

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
        ...                   d_ff=32)
        >>> res = perplexity(Llama(cfg, rngs=nnx.Rngs(0)), list(range(20)), window=8,
        ...                  progress=False)
        >>> res.n_tokens, res.n_windows  # windows [0,8) [8,16) [12,20): 7 + 7 + 4 scored
        (18, 3)
    """
    ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
    n = ids.shape[0]
    cfg = model.cfg
    if n < 2:
        raise ValueError(f"token_ids has {n} tokens; perplexity needs at least 2.")
    if window < 2 or window > cfg.max_seq_len:
        raise ValueError(
            f"window={window} must lie in [2, {cfg.max_seq_len}] (the model's context)."
        )
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(
            f"token ids must lie in [0, {cfg.vocab_size}); got {ids.min()}..{ids.max()}."
        )
    width = min(window, n)
    static, state = prepare(model, scan_layers=cache_factory is None)

    def score(chunk, lo, hi):
        cache = None if cache_factory is None else cache_factory(cfg, 1, width)
        return _window_nll(static, state, chunk, lo, hi, cache)

    return windowed_perplexity(score, ids, window=window, stride=stride, progress=progress)


def english_eval_text(*, include_python_license: bool = True) -> str:
    """Plain English for perplexity checks, available offline on any machine.

    The shipped ``models/data/licenses.txt`` (MIT, BSD-3-Clause and the Apache-2.0 terms,
    about 2,900 SmolLM2 tokens), then the Python interpreter's own ``LICENSE.txt`` (history of the
    software and the PSF license, about 3,000 more) when the standard library has it, then the
    Zen of Python. License texts are common in web-scale training data, so perplexities on them
    are lower than on unseen prose (DERIVED: the only English prose every installation carries).

    Args:
        include_python_license: append the interpreter's license and the Zen of Python.

    Returns:
        The text (paragraphs separated by blank lines).

    Example::

        >>> len(english_eval_text(include_python_license=False).split()) > 1500
        True
    """
    import codecs
    import importlib.resources
    import os
    import sysconfig

    parts = [
        importlib.resources.files("lowrank_jax.models").joinpath("data/licenses.txt")
        .read_text(encoding="utf-8")
    ]
    if include_python_license:
        for key in ("stdlib", "platstdlib"):
            path = os.path.join(sysconfig.get_paths().get(key, ""), "LICENSE.txt")
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    parts.append(f.read())
                break
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            import this  # prints the Zen on first import; its text is rot13 in this.s
        parts.append(codecs.decode(this.s, "rot13"))
    return "\n\n".join(part.strip() for part in parts) + "\n"


def logits_full(
    model: Llama, token_ids: Int[Array, "b t"], *, scan_layers: bool = True
) -> Float[Array, "b t vocab"]:
    """Logits of a full (cache-free) forward pass, jitted.

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models.llama import Llama, LlamaConfig
        >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2,
        ...                   d_ff=32)
        >>> logits_full(Llama(cfg, rngs=nnx.Rngs(0)), jnp.zeros((1, 5), jnp.int32)).shape
        (1, 5, 32)
    """
    static, state = prepare(model, scan_layers=scan_layers)
    return _full(static, state, jnp.asarray(token_ids, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _full(static, state, tokens):
    return forward(static, state, tokens)[0]


__all__ = [
    "GenerationResult",
    "PerplexityResult",
    "decode_step",
    "english_eval_text",
    "forward",
    "generate",
    "logits_full",
    "perplexity",
    "prepare",
    "sample_token",
]
