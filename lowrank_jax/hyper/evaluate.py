"""Scoring a hypernetwork's adapters on question → answer pairs, and caching prepared data.

- :func:`answer_scores`: per example, exact match (the argmax is right on every answer token),
  the answer's log-probability, and the fraction of right digit tokens (partial learning);
- :func:`hypernetwork_evaluator`: the same scores of a :class:`~lowrank_jax.hyper.DocToLoRA`'s
  adapters on fixed sets of documents, one compiled pass per set (hypernetwork + adapted model),
  in the ``evaluate=`` shape :func:`~lowrank_jax.hyper.train_doc_to_lora` takes;
- :func:`cached_distill_data`: :func:`~lowrank_jax.hyper.build_distill_data` cached on disk under
  a hash of the tokens, the model name and the settings (the teacher pass is the slow part);
- :func:`teacher_floor`: the floor of the top-k distillation loss (the teacher's own entropy).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.core.losses import token_logprob
from lowrank_jax.hyper.doc_to_lora import adapted
from lowrank_jax.hyper.train import DistillData, build_distill_data, context_distiller


def pad_tokens(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """``[len(rows), longest]`` int32 token ids, right-padded with 0.

    Example::

        >>> pad_tokens([[1, 2, 3], [4]]).tolist()
        [[1, 2, 3], [4, 0, 0]]
    """
    out = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def answer_scores(logits, tokens, starts: Sequence[int], answers: Sequence[Sequence[int]]):
    """``(hits, logps, digits)`` per example of a batch of ``question + answer`` rows.

    Row ``i``'s answer ``answers[i]`` is predicted from positions ``starts[i] ..
    starts[i] + len(answers[i]) - 1`` of ``logits`` (``starts[i]`` = the question's last
    position). ``hits``: every answer token is the argmax; ``logps``: the answer's log-prob
    (nats); ``digits``: the fraction of right tokens after the first (the first is the space).

    Args:
        logits: ``[batch, time, vocab]``.
        tokens: ``[batch, time]`` ids (unused but for the batch size; kept for symmetry).
        starts: per row, the position whose logits predict the first answer token.
        answers: per row, the answer's token ids.

    Example::

        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([[[0.1, 0.9], [0.8, 0.2]]]))
        >>> hits, lps, digits = answer_scores(logits, jnp.zeros((1, 2), int), [0], [[1, 0]])
        >>> hits, round(lps[0], 4), digits
        ([True], -0.3285, [1.0])
    """
    del tokens
    logits = jnp.asarray(logits)
    hits, lps, digits = [], [], []
    for i, (s, a) in enumerate(zip(starts, answers)):
        pos = np.arange(s, s + len(a))
        rows = logits[i, pos]
        right = np.asarray(jnp.argmax(rows, -1)) == np.asarray(a)
        hits.append(bool(np.all(right)))
        lps.append(float(np.asarray(token_logprob(rows, jnp.asarray(a))).sum()))
        digits.append(float(np.mean(right[1:])))  # a[0] is the space token
    return hits, lps, digits


def hypernetwork_evaluator(model, hyper, sets: dict):
    """``(evaluate, scores)`` of ``hyper``'s adapters on named sets of documents.

    Args:
        model: the base model the adapters plug into.
        hyper: the :class:`~lowrank_jax.hyper.DocToLoRA` (its structure; the weights are read
            at each call).
        sets: ``{name: (data, questions, answers)}``: the :class:`DistillData` of the documents
            (its ``features`` / ``mask``) and each document's question and answer token ids.

    Returns:
        ``evaluate(hyper) -> {f"{name}_acc", f"{name}_digits", f"{name}_logp"}`` (means over
        each set) and ``scores(hyper, name) -> (hits, logps, digits)`` (per document, see
        :func:`answer_scores`).
    """
    hgraph, _ = nnx.split(hyper)
    graph, state = nnx.split(model)
    config = hyper.config

    @jax.jit
    def logits_fn(hstate, state, features, mask, tokens):
        bank = nnx.merge(hgraph, hstate)(features, mask)
        m = nnx.merge(graph, state)
        with adapted(m, bank, config):
            return m(tokens)[0]

    prepared = {name: (jnp.asarray(d.features), jnp.asarray(d.mask),
                       jnp.asarray(pad_tokens([q + a for q, a in zip(qs, ans)])),
                       [len(q) - 1 for q in qs], ans)
                for name, (d, qs, ans) in sets.items()}

    def scores(hyper, name):
        feats, mask, tokens, starts, ans = prepared[name]
        logits = logits_fn(nnx.split(hyper)[1], state, feats, mask, tokens)
        return answer_scores(logits, tokens, starts, ans)

    def evaluate(hyper):
        row = {}
        for name in prepared:
            hits, lps, digits = scores(hyper, name)
            row.update({f"{name}_acc": float(np.mean(hits)),
                        f"{name}_digits": float(np.mean(digits)),
                        f"{name}_logp": float(np.mean(lps))})
        return row

    return evaluate, scores


def context_distillation_scores(model, config, data: DistillData, questions, answers, *,
                                total_rank: int, steps: int, learning_rate: float,
                                n_docs: int | None = None):
    """Per-document context distillation (:func:`~lowrank_jax.hyper.context_distiller`, the
    slow baseline) scored like :func:`answer_scores`, without the document in the prompt.

    Document ``i`` of ``data`` gets a fresh rank-``total_rank`` adapter (seed ``i``), trained
    ``steps`` Adam steps, then answers ``questions[i]``. Only the first ``n_docs`` documents
    are distilled (default all).

    Returns:
        ``(hits, logps, digits, seconds)``: per document, the scores and the wall seconds of its
        distillation (the first one includes compilation).
    """
    distill = context_distiller(model, config, total_rank=total_rank, steps=steps,
                                learning_rate=learning_rate)
    tokens = jnp.asarray(pad_tokens([q + a for q, a in zip(questions, answers)]))
    hits, logps, digits, seconds = [], [], [], []
    for i in range(len(questions) if n_docs is None else min(n_docs, len(questions))):
        one = DistillData(*(np.asarray(x)[i:i + 1] for x in data))
        start = time.time()
        bank = distill(one, seed=i)
        bank.a.block_until_ready()
        seconds.append(time.time() - start)
        with adapted(model, bank, config):
            logits = model(tokens[i:i + 1])[0]
        h, lp, dg = answer_scores(logits, tokens[i:i + 1], [len(questions[i]) - 1],
                                  answers[i:i + 1])
        hits += h
        logps += lp
        digits += dg
    return hits, logps, digits, seconds


def plot_learning_curve(curve: Sequence[dict], floor: float, path, title: str) -> None:
    """The curve of :func:`~lowrank_jax.hyper.train_doc_to_lora`'s evaluations: held-out and
    seen exact / digit accuracy (``evaluate=`` of :func:`hypernetwork_evaluator`) beside the
    training KL and the teacher's floor (:func:`teacher_floor`)."""
    from lowrank_jax.analysis.report import plot_panels

    steps = [r["step"] for r in curve]
    accuracy = [{"x": steps, "y": [r[key] for r in curve], "style": style, "ms": 3, "label": label}
                for key, style, label in (("heldout_acc", "o-", "held-out exact"),
                                          ("heldout_digits", "s-", "held-out digit acc."),
                                          ("seen_acc", "o--", "seen exact"),
                                          ("seen_digits", "s--", "seen digit acc."))]
    kl = [{"x": steps, "y": [r["kl_mean"] for r in curve],
           "label": "train top-16 KL (mean since previous eval)"}]
    plot_panels([{"curves": accuracy, "hlines": [(0.1, "digit chance (0.1)", ":")],
                  "xlabel": "step", "ylabel": "accuracy (no document in the prompt)",
                  "ylim": (-0.02, 1.02), "legend_fontsize": 8, "grid": True},
                 {"curves": kl, "hlines": [(floor, f"teacher floor ({floor:.2f})", "--")],
                  "xlabel": "step", "ylabel": "top-16 KL", "legend_fontsize": 8, "grid": True}],
                str(path), suptitle=title, figsize=(11, 4), dpi=110)


def cached_distill_data(cache_dir, model_name: str, model, tokens, build: dict,
                        *, log=print) -> DistillData:
    """:func:`~lowrank_jax.hyper.build_distill_data` of ``tokens`` (documents, questions,
    answers), cached as ``cache_dir/distill_<key>.npz`` under a hash of the tokens, the model
    name and the ``build`` keyword arguments (written atomically: a crash leaves no half file).

    Example::

        >>> import tempfile
        >>> from lowrank_jax.models.presets import preset_model
        >>> model, folder = preset_model("tiny", seed=0), tempfile.mkdtemp()
        >>> tokens = ([[1, 2, 3, 4]], [[5, 6]], [[7]])
        >>> build = dict(layers=[0], chunk_len=4, max_chunks=1, top_k=2)
        >>> a = cached_distill_data(folder, "tiny", model, tokens, build)
        >>> b = cached_distill_data(folder, "tiny", model, tokens, build, log=lambda s: None)
        >>> bool((a.teacher_logp == b.teacher_logp).all())
        True
    """
    key = hashlib.sha256(json.dumps([model_name, build, tokens]).encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"distill_{key}.npz"
    if path.exists():
        with np.load(path) as f:
            if log is not None:
                log(f"prepared data from the cache {path.name}")
            return DistillData(*(f[k] for k in DistillData._fields))
    data = build_distill_data(model, *tokens, **build)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez(tmp, **data._asdict())
    os.replace(tmp, path)
    return data


def teacher_floor(data: DistillData) -> float:
    """The top-k distillation loss's floor: the teacher's own top-k cross-entropy
    ``−Σ_k p_k log p_k`` per position, weight-averaged per document, then averaged.

    Example::

        >>> import numpy as np
        >>> lp = np.log(np.full((1, 1, 2), 0.5))
        >>> data = DistillData(*([None] * (len(DistillData._fields) - 3)), np.ones((1, 1)),
        ...                    lp, np.zeros((1, 1, 2), int))
        >>> round(teacher_floor(data), 4)
        0.6931
    """
    p = np.exp(data.teacher_logp)
    per_token = -np.sum(p * data.teacher_logp, axis=-1)
    w = data.weights
    return float(np.mean(np.sum(per_token * w, 1) / np.maximum(np.sum(w, 1), 1e-9)))


def compiled_temp_bytes(fn, *args) -> int | None:
    """Working memory XLA plans for ``fn(*args)`` (temporary + output buffers, bytes), or
    ``None`` where the backend reports no memory statistics.

    Example::

        >>> import jax.numpy as jnp
        >>> n = compiled_temp_bytes(lambda x: x @ x.T, jnp.ones((8, 4)))
        >>> n is None or n >= 8 * 8 * 4
        True
    """
    try:
        stats = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - backends without memory stats
        return None


def working_memory(model, hyper, data: DistillData, *, layers: Sequence[int], chunk_len: int,
                   max_chunks: int, total_rank: int) -> dict:
    """Working memory (bytes, :func:`compiled_temp_bytes`) XLA plans for internalising one
    document two ways: one Doc-to-LoRA pass (the base model's pass over ``max_chunks`` chunks
    of ``chunk_len`` tokens, its layer inputs at ``layers``, the hypernetwork) and one step of
    per-document context distillation (the gradient of :func:`~lowrank_jax.hyper.distill_loss`
    with respect to a rank-``total_rank`` adapter, on the first document of ``data``).

    Returns:
        ``{"doc_to_lora": bytes, "context_distillation_step": bytes}`` (``None`` values where
        the backend has no memory statistics).
    """
    from lowrank_jax.hyper.doc_to_lora import LoRABank
    from lowrank_jax.hyper.train import distill_loss
    from lowrank_jax.nn.capture import capture

    graph, state = nnx.split(model)
    hgraph, hstate = nnx.split(hyper)
    paths = [f"layers/{i}" for i in layers]

    def d2l_fn(hstate, state, ids):
        m = nnx.merge(graph, state)
        with capture(m, paths) as rec:
            m(ids)
        feats = jnp.stack([rec.inputs[q][0] for q in paths], axis=1)
        return nnx.merge(hgraph, hstate)(feats[None], jnp.ones((1,) + ids.shape, bool))

    def cd_fn(ab, state, batch):
        return jax.grad(lambda p: distill_loss(LoRABank(*p), nnx.merge(graph, state),
                                               hyper.config, batch)[0])(ab)

    one = DistillData(*(jnp.asarray(np.asarray(x)[:1]) for x in data))
    ab = (jnp.zeros((1, len(layers), total_rank, hyper.config.d_in)),
          jnp.zeros((1, len(layers), total_rank, hyper.config.d_out)))
    ids = jnp.zeros((max_chunks, chunk_len), jnp.int32)
    return {"doc_to_lora": compiled_temp_bytes(d2l_fn, hstate, state, ids),
            "context_distillation_step": compiled_temp_bytes(cd_fn, ab, state, one)}


__all__ = ["answer_scores", "cached_distill_data", "compiled_temp_bytes",
           "context_distillation_scores", "hypernetwork_evaluator", "pad_tokens",
           "plot_learning_curve", "teacher_floor", "working_memory"]
