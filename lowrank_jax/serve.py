"""Serve LoRA adapters: several PEFT adapters resident at once, hot-swapped without recompiling.

:class:`AdapterServer` turns the projections of a dense Llama into
:class:`~lowrank_jax.nn.MultiLoRALinear` layers with ``slots`` adapter slots of one padded rank
``R`` (PEFT's hot-swap recipe: ranks padded to a maximum). Every slot is declared with rank ``R``
and ``alpha = R`` (scale 1); an adapter of rank ``r ≤ R`` and scale ``s = α/r`` is stored as

.. math:: A' = [A,\\ 0_{in \\times (R-r)}],\\qquad B' = \\begin{bmatrix} s B \\\\ 0 \\end{bmatrix},
          \\qquad x A' B' = s\\, x A B

so loading another adapter into a slot writes arrays of the same shapes: the model's graph (and
so every jitted function over it) does not change and nothing recompiles. Example ``b`` of a
batch uses slot ``ids[b]`` (the grouped multi-LoRA forward).

Adapters are PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``), written by
:func:`lowrank_jax.io.peft.export_peft` or by HuggingFace PEFT itself.

References:
    HuggingFace PEFT, `hotswap_adapter
    <https://huggingface.co/docs/peft/package_reference/hotswap>`_; Yan et al,
    `PLoRA <https://arxiv.org/abs/2508.02932>`_, 2025.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.nn.multi_lora import apply_multi_lora, multi_lora_layers, set_adapter_ids

from lowrank_jax.models.llama import PROJECTIONS as TARGETS  # noqa: E402 (one list)


def read_peft_adapter(folder: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """``{our module path: (A [in, r], B [r, out], scale)}`` from a PEFT LoRA folder.

    Honours ``rank_pattern`` / ``alpha_pattern`` and ``use_rslora``; the folder is checked by
    :func:`lowrank_jax.io.adapters.read_adapter`, as every adapter reader does.
    """
    from lowrank_jax.io.adapters import pattern_value, read_adapter
    from lowrank_jax.io.peft import our_module_path
    from lowrank_jax.nn.lora import lora_scaling

    config, stored = read_adapter(folder, who=f"adapter={folder}")  # the one adapter check
    pairs = {name: {k: np.asarray(v, np.float32) for k, v in pair.items()}
             for name, pair in stored.items()}
    alpha_default = config.get("lora_alpha", 8)
    use_rslora = bool(config.get("use_rslora", False))
    out = {}
    for name, pair in sorted(pairs.items()):
        rank = int(pair["lora_A"].shape[0])
        alpha = float(pattern_value(name, config.get("alpha_pattern") or {}, alpha_default))
        out[our_module_path(name)] = (pair["lora_A"].T, pair["lora_B"].T,
                                      lora_scaling(rank, alpha, use_rslora))
    return out


class AdapterServer:
    """K adapter slots of padded rank ``max_rank`` over one frozen dense Llama (in place).

    Example::

        >>> from lowrank_jax.models.presets import preset_model
        >>> server = AdapterServer(preset_model("tiny"), slots=2, max_rank=8)
        >>> server.logits(jnp.zeros((2, 4), jnp.int32), [0, 1]).shape
        (2, 4, 256)

    Args:
        model: a dense :class:`~lowrank_jax.models.Llama` (modified in place).
        slots: adapters resident at once (one batch may mix them).
        max_rank: the padded rank ``R``; every adapter served must have ``r ≤ R``.
        targets: projection names that get slots.
        implementation: ``MultiLoRALinear``'s (``"gather"``: any id order, no sort).
    """

    def __init__(self, model, *, slots: int, max_rank: int,
                 targets: Sequence[str] = TARGETS, implementation: str = "gather"):
        if slots < 1 or max_rank < 1:
            raise ValueError(f"AdapterServer: slots={slots} and max_rank={max_rank} must be "
                             ">= 1.")
        self.model, self.slots, self.max_rank = model, int(slots), int(max_rank)
        n = apply_multi_lora(model, ranks=(self.max_rank,) * self.slots,
                             alphas=(float(self.max_rank),) * self.slots, targets=tuple(targets),
                             implementation=implementation, rngs=nnx.Rngs(0))
        if n == 0:
            raise ValueError(f"AdapterServer: the model has no dense projection named "
                             f"{tuple(targets)}; serving needs a dense (or fp-merged) base.")
        self.layers = dict(multi_lora_layers(model))
        for layer in self.layers.values():  # empty slots add nothing
            layer.lora_a[...] = jnp.zeros_like(layer.lora_a[...])
        self.names: list[str | None] = [None] * self.slots
        self.traces = 0

        def forward(model, tokens):
            self.traces += 1  # Python runs only while tracing: this counts compilations
            return model(tokens)[0]

        self._forward = nnx.jit(forward)

    def load(self, slot: int, folder: str | os.PathLike) -> list[str]:
        """Put the PEFT adapter in ``folder`` into ``slot`` (replacing what was there)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"AdapterServer.load: slot={slot} must lie in [0, {self.slots}).")
        adapter = read_peft_adapter(folder)
        unknown = sorted(set(adapter) - set(self.layers))
        if unknown:
            raise ValueError(f"adapter={folder}: targets {unknown[:4]} which the served model "
                             f"has no slot for; served modules: {sorted(self.layers)[:6]} ...")
        for path, layer in self.layers.items():
            a = np.zeros((layer.in_features, self.max_rank), np.float32)
            b = np.zeros((self.max_rank, layer.out_features), np.float32)
            if path in adapter:
                a_k, b_k, scale = adapter[path]
                r = a_k.shape[1]
                if r > self.max_rank:
                    raise ValueError(f"adapter={folder}: {path} has rank {r} > max_rank="
                                     f"{self.max_rank}; raise `max_rank` to at least {r}.")
                if a_k.shape[0] != layer.in_features or b_k.shape[1] != layer.out_features:
                    raise ValueError(f"adapter={folder}: {path} has A {a_k.shape}, B "
                                     f"{b_k.shape}; this model needs [{layer.in_features}, r] "
                                     f"and [r, {layer.out_features}] (another base model?).")
                a[:, :r], b[:r] = a_k, scale * b_k
            dtype = layer.lora_a[...].dtype
            layer.set_adapter(slot, jnp.asarray(a, dtype), jnp.asarray(b, dtype))
        self.names[slot] = os.fspath(folder)
        return sorted(adapter)

    def set_ids(self, ids: Sequence[int]) -> None:
        """Route example ``b`` to slot ``ids[b]`` for plain ``model(tokens)`` calls (e.g.
        :func:`lowrank_jax.models.generate.generate` with batch 1: ``set_ids([k])``)."""
        ids = jnp.asarray(ids, jnp.int32)
        if ids.ndim != 1 or bool(jnp.any((ids < 0) | (ids >= self.slots))):
            raise ValueError(f"AdapterServer: ids={ids.tolist()} must be a list of slot numbers "
                             f"in [0, {self.slots}).")
        set_adapter_ids(self.model, ids)

    def logits(self, tokens, ids: Sequence[int]):
        """``[b, t, vocab]`` logits of ``tokens [b, t]``, example ``b`` with adapter slot
        ``ids[b]`` (one jitted function; loading adapters never retraces it)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if len(ids) != tokens.shape[0]:
            raise ValueError(f"AdapterServer.logits: {len(ids)} ids for a batch of "
                             f"{tokens.shape[0]}; give one slot id per example.")
        self.set_ids(ids)
        return self._forward(self.model, tokens)


def generate_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
                   temperature: float = 0.0, top_p: float = 1.0, key=None,
                   eos_ids: Sequence[int] = (), stop_at_eos: bool = True):
    """Continue several token-id prompts **in one batch**, one compiled decode step for all.

    Prompts may differ in length and are never padded: one prefill runs the common prefix of
    ``min(len)`` positions, then every decode step feeds example ``b`` its next prompt token
    while position ``p < len_b`` (teacher forcing the rest of its prompt) and its own sampled
    token after, so every example sees exactly the positions it would see alone. With the model's
    adapter ids set (:meth:`AdapterServer.set_ids`), example ``b`` runs with its own adapter.
    Greedy decoding (``temperature=0``) gives each example the tokens it gets alone (a test).

    Returns:
        One :class:`~lowrank_jax.models.generate.GenerationResult` per prompt (``text`` is
        ``None``: decode the ids with the tokenizer).
    """
    import jax

    from lowrank_jax.models.generate import GenerationResult, decode_step, prepare, sample_token
    from lowrank_jax.models.llama import KVCache

    cfg = model.cfg
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate_batch: give at least one prompt, each of at least one token.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    lengths = [len(p) for p in prompts]
    if max(lengths) >= cfg.max_seq_len:
        raise ValueError(f"a prompt has {max(lengths)} tokens but the model's context is "
                         f"{cfg.max_seq_len}; shorten the prompt.")
    budget = [min(max_new_tokens, cfg.max_seq_len - n) for n in lengths]
    n_batch, lo = len(prompts), min(lengths)
    key = jax.random.key(0) if key is None else key
    eos_set = {int(i) for i in eos_ids}
    static, state = prepare(model)  # the shared prompt prefix: layers scanned (fast compile)
    cache = KVCache.empty(cfg, n_batch, max(n + k for n, k in zip(lengths, budget)))
    logits, cache = decode_step(static, state, jnp.asarray([p[:lo] for p in prompts],
                                                            jnp.int32), cache)
    # one token per step: layers unrolled, each matmul reads its weights in place (as generate)
    static, state = prepare(model, scan_layers=False)
    step = functools.partial(decode_step, static)  # jitted: logits[:, -1] and the cache
    temperature_arr, top_p_arr = jnp.float32(temperature), jnp.float32(top_p)
    new_ids: list[list[int]] = [[] for _ in prompts]
    stopped = [False] * n_batch
    pos = lo  # the position the next fed token takes
    while True:
        key, sub = jax.random.split(key)
        sampled = np.asarray(sample_token(logits, sub, temperature_arr, top_p_arr))
        feed = []
        for b, prompt in enumerate(prompts):
            if pos < lengths[b]:  # still inside its prompt: feed the prompt's own token
                feed.append(prompt[pos])
                continue
            done = stopped[b] or len(new_ids[b]) >= budget[b]
            if not done:
                token = int(sampled[b])
                new_ids[b].append(token)
                stopped[b] = stop_at_eos and token in eos_set
            feed.append(new_ids[b][-1] if new_ids[b] else 0)  # finished rows: ignored filler
        if all(s or len(ids) >= k for s, ids, k in zip(stopped, new_ids, budget)):
            break
        logits, cache = step(state, jnp.asarray(feed, jnp.int32)[:, None], cache)
        pos += 1
    return [GenerationResult(ids, None, s, None) for ids, s in zip(new_ids, stopped)]


def generate_with_adapters(model, tokenizer, prompts: Sequence[str], adapters: Sequence[str], *,
                           max_rank: int | None = None, **generate_kwargs):
    """Answer ``prompts[i]`` with adapter ``adapters[i]`` (PEFT folders) in **one batch**.

    One :class:`AdapterServer` holds every adapter (slot ``i`` = ``adapters[i]``); the prompts
    run together through :func:`generate_batch` with example ``i`` routed to slot ``i`` (the
    grouped multi-LoRA forward). ``max_rank`` defaults to the largest adapter rank rounded up
    to 8. ``generate_kwargs``: those of :func:`generate_batch`.

    Returns:
        One :class:`~lowrank_jax.models.generate.GenerationResult` per prompt (with its text).
    """
    if len(prompts) != len(adapters):
        raise ValueError(f"`adapters` holds {len(adapters)} folders but `prompts` "
                         f"{len(prompts)} prompts; give one prompt per adapter.")
    if max_rank is None:
        ranks = [a.shape[1] for folder in adapters
                 for a, _, _ in read_peft_adapter(folder).values()]
        max_rank = -(-max(ranks, default=1) // 8) * 8
    server = AdapterServer(model, slots=len(adapters), max_rank=max_rank)
    for slot, folder in enumerate(adapters):
        server.load(slot, folder)
    server.set_ids(list(range(len(adapters))))
    eos = getattr(tokenizer, "eos_id", None)
    generate_kwargs.setdefault("eos_ids", () if eos is None else (eos,))
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    results = generate_batch(model, ids, **generate_kwargs)
    return [r._replace(text=tokenizer.decode(r.token_ids)) if tokenizer is not None else r
            for r in results]


__all__ = ["AdapterServer", "TARGETS", "generate_batch", "generate_with_adapters",
           "read_peft_adapter"]
