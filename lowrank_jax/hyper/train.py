"""Doc-to-LoRA training: distil the base model that *sees* the document into the base model plus
the generated adapter that does not (top-k KL + L1 on the generated weights), resumable with the
package's verified orbax checkpoints (:mod:`lowrank_jax.io.checkpoint`).

.. math:: \\mathcal L = \\frac1D\\sum_d \\frac{\\sum_t w_{dt}\\,
          \\big(-\\sum_{v\\in\\mathrm{top}k_T} p_T(v)\\log \\mathrm{softmax}(z_S)_v\\big)}
          {\\sum_t w_{dt}} + \\lambda_1 (\\overline{|A|} + \\overline{|B|})

Every document counts equally whatever its number of answer tokens; the teacher's top-k
log-probabilities are stored at the *student's* positions (logits at ``t`` predict ``t + 1``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.core.losses import ids_logprob, token_nll, top_logprobs
from lowrank_jax.core.loop import iterate_steps, run_steps
from lowrank_jax.core.step import make_step
from lowrank_jax.hyper.doc_to_lora import (
    DocToLoRA,
    LoRABank,
    adapted,
    chunk_document,
    chunk_encoder,
)
from lowrank_jax.nn.capture import capture


def topk_distill(student_logits, teacher_logp, teacher_idx, weights=None):
    """Top-k distillation ``−Σ_{v∈topk} p_T(v) log softmax(z_S)_v``, averaged over positions.

    Args:
        student_logits: ``[N, V]``.
        teacher_logp: ``[N, k]`` teacher log-probabilities of its top-k tokens (not renormalised).
        teacher_idx: ``[N, k]`` their token ids.
        weights: optional ``[N]`` position weights (0 = ignore); the mean is weighted.

    Example::

        >>> import jax.numpy as jnp
        >>> z = jnp.log(jnp.array([[0.5, 0.25, 0.25]]))
        >>> round(float(topk_distill(z, jnp.zeros((1, 1)), jnp.zeros((1, 1), jnp.int32))), 4)
        0.6931
    """
    picked = ids_logprob(student_logits, teacher_idx)
    per_position = -jnp.sum(jnp.exp(teacher_logp.astype(jnp.float32)) * picked, axis=-1)
    if weights is None:
        return jnp.mean(per_position)
    weights = weights.astype(jnp.float32)
    return jnp.sum(per_position * weights) / jnp.maximum(jnp.sum(weights), 1e-9)


def l1_penalty(bank: LoRABank):
    """``mean|A| + mean|B|`` of the merged bank (chunks and bias; linear in every entry)."""
    return jnp.mean(jnp.abs(bank.a)) + jnp.mean(jnp.abs(bank.b))


class DistillData(NamedTuple):
    """Training / evaluation examples, one question per document (numpy arrays).

    ``features [N, C, L, T, d]`` and ``mask [N, C, T]``: the encoded document chunks;
    ``queries [N, Q]``: question + answer tokens without the document (right-padded);
    ``weights [N, Q]``: 1 where the logits predict an answer token; ``teacher_logp`` /
    ``teacher_idx [N, Q, k]``: the teacher's top-k at those positions.
    """

    features: Any
    mask: Any
    queries: Any
    weights: Any
    teacher_logp: Any
    teacher_idx: Any


def _pad(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


_TEACHER_PASSES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _teacher_pass(model, top_k: int, paths: tuple, chunk_len: int):
    """``run(tokens, gather) -> (logp, idx, feats)``: one jitted pass of the teacher over
    ``document + question + answer`` rows with the weights ``model`` has now. It gives the
    top-k log-probabilities at the ``gather`` positions only (the LM head runs on those rows,
    not on every position) and the inputs of the decoder layers ``paths`` at the first
    ``chunk_len`` positions, which *are* the document's first-chunk features (the model is
    causal: a prefix does not see what follows it). The jitted function is kept per model, so
    its compilations (one per ``(batch, width)``) serve every later call."""
    graphdef, state = nnx.split(model)
    cached = _TEACHER_PASSES.get(model)
    if cached is None or cached[0] != graphdef:
        cached = _TEACHER_PASSES[model] = (graphdef, {})
    key = (top_k, paths, chunk_len)
    if key not in cached[1]:
        @jax.jit
        def run(state, tokens, gather):
            m = nnx.merge(graphdef, state)
            with capture(m, list(paths)) as rec:
                hidden, _ = m.hidden_states(tokens)
            rows = jnp.take_along_axis(hidden, gather[..., None], axis=1)  # [B, A, d]
            logp, idx = top_logprobs(m.logits_from_hidden(rows), top_k)
            feats = jnp.stack([rec.inputs[p][0][:, :chunk_len] for p in paths], axis=1)
            return logp, idx, feats.astype(jnp.float32)

        cached[1][key] = run
    run = cached[1][key]
    return lambda tokens, gather: run(state, jnp.asarray(tokens), jnp.asarray(gather))


def _buckets(lengths: Sequence[int], batch_size: int, bucket: int):
    """Row groups ``(width, rows)``: rows sorted by length, widths rounded up to a multiple of
    ``bucket`` (few shapes, so few compilations), at most ``batch_size`` rows each."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(-(-lengths[i] // bucket) * bucket, []).append(i)
    return [(width, rows[s:s + batch_size]) for width, rows in sorted(groups.items())
            for s in range(0, len(rows), batch_size)]


def build_distill_data(model, documents: Sequence[Sequence[int]],
                       questions: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *,
                       layers: Sequence[int], chunk_len: int, max_chunks: int, top_k: int = 16,
                       batch_size: int = 32, bucket: int = 16,
                       feature_dtype: Any = np.float32) -> DistillData:
    """Encode the documents and record the teacher (the model reading ``document + question``)
    on the answer tokens.

    The student sees ``question + answer``; position ``len(question) - 1 + j`` of its logits
    predicts answer token ``j``, and the teacher's top-k there comes from position
    ``len(document) + len(question) - 1 + j`` of the teacher's.

    Batched for thousands of documents: rows are grouped by length (widths rounded up to a
    multiple of ``bucket``; one compilation per width) into batches of ``batch_size``; one
    teacher pass gives both the top-k (LM head on the answer positions only) and the first
    chunk's features (the layer inputs at the document's positions, equal to encoding the
    chunk alone since the model is causal); only chunks 2.. get an encoder pass of their own.
    Features at masked (padding) positions are 0. ``feature_dtype`` (e.g. ``np.float16``)
    halves the memory of the stored features; the hypernetwork computes in float32.
    """
    n = len(documents)
    if not (n == len(questions) == len(answers)) or n == 0:
        raise ValueError(f"documents, questions and answers must be non-empty and equally long; "
                         f"got {n}, {len(questions)}, {len(answers)}.")
    if any(len(a) == 0 for a in answers):
        raise ValueError("every answer needs at least one token.")
    for key, value in (("batch_size", batch_size), ("bucket", bucket)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{key}={value!r} must be a positive integer.")
    chunks = [chunk_document(doc, chunk_len, max_chunks) for doc in documents]
    ids = np.stack([c[0] for c in chunks])
    mask = np.stack([c[1] for c in chunks])
    n_layers, d_model = len(layers), model.cfg.d_model
    features = np.zeros((n, max_chunks, n_layers, chunk_len, d_model), feature_dtype)
    student = [list(q) + list(a) for q, a in zip(questions, answers)]
    width = max(len(s) for s in student)
    n_answer = max(len(a) for a in answers)
    weights = np.zeros((n, width), np.float32)
    out_logp = np.zeros((n, width, top_k), np.float32)
    out_idx = np.zeros((n, width, top_k), np.int32)

    teacher = [list(d) + s for d, s in zip(documents, student)]
    # rows at least chunk_len wide, so the first chunk's features are all there
    lengths = [max(len(t), chunk_len) for t in teacher]
    run = _teacher_pass(model, top_k, tuple(f"layers/{int(i)}" for i in layers), chunk_len)
    for w, rows in _buckets(lengths, batch_size, bucket):
        tokens = np.zeros((batch_size, w), np.int32)
        gather = np.zeros((batch_size, n_answer), np.int32)
        for r, i in enumerate(rows):
            tokens[r, :len(teacher[i])] = teacher[i]
            t0 = len(documents[i]) + len(questions[i]) - 1
            gather[r, :len(answers[i])] = np.arange(t0, t0 + len(answers[i]))
        logp, idx, feats = (np.asarray(x) for x in run(tokens, gather))
        for r, i in enumerate(rows):
            s0, k = len(questions[i]) - 1, len(answers[i])
            weights[i, s0:s0 + k] = 1.0
            out_logp[i, s0:s0 + k] = logp[r, :k]
            out_idx[i, s0:s0 + k] = idx[r, :k]
            features[i, 0] = feats[r] * mask[i, 0][None, :, None]

    later = [(i, c) for i in range(n) for c in range(1, max_chunks) if mask[i, c].any()]
    if later:
        encode = chunk_encoder(model, layers)
        block = min(batch_size, len(later))
        for s in range(0, len(later), block):
            part = later[s:s + block]
            tokens = np.zeros((block, chunk_len), np.int32)
            for r, (i, c) in enumerate(part):
                tokens[r] = ids[i, c]
            feats = np.asarray(encode(tokens))
            for r, (i, c) in enumerate(part):
                features[i, c] = feats[r] * mask[i, c][None, :, None]
    return DistillData(features, mask, _pad(student, width), weights, out_logp, out_idx)


def distill_loss(bank: LoRABank, model, config, batch: DistillData, *, l1_weight: float = 0.1,
                 ce_weight: float = 0.0):
    """``(total, (kl, l1))`` of the student (``model`` + ``bank``) on ``batch``; per-document
    averaged KL, then the mean over documents.

    ``ce_weight > 0`` adds the NIAH run's objective as an auxiliary term: ``ce_weight`` times
    the cross-entropy of the answer tokens themselves (``queries`` shifted by one, at the
    positions ``weights`` marks), averaged per document like the KL.
    """
    with adapted(model, bank, config):
        logits, _ = model(batch.queries)
    picked = ids_logprob(logits, batch.teacher_idx)
    per_token = -jnp.sum(jnp.exp(batch.teacher_logp) * picked, axis=-1)  # [D, Q]
    w = batch.weights.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(w, axis=1), 1e-9)
    kl = jnp.mean(jnp.sum(per_token * w, axis=1) / denom)
    l1 = l1_penalty(bank)
    total = kl + l1_weight * l1
    if ce_weight:
        labels = jnp.concatenate([batch.queries[:, 1:], batch.queries[:, -1:]], axis=1)
        nll = token_nll(logits, labels)
        total = total + ce_weight * jnp.mean(jnp.sum(nll * w, axis=1) / denom)
    return total, (kl, l1)


@dataclasses.dataclass
class HyperTrainState:
    """What a checkpoint holds: ``step``, ``params`` (the hypernetwork's), ``opt_state``."""

    step: int
    params: Any
    opt_state: Any


def default_optimizer(learning_rate: float = 1e-4, steps: int = 1000, warmup: int = 10,
                      weight_decay: float = 0.01) -> optax.GradientTransformation:
    """AdamW (β 0.9/0.999, ε 1e-8) with linear warm-up and cosine decay, as in the paper."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(warmup, steps - 1),
                                                  max(steps, 2), learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=weight_decay))


CURVE_NAME = "curve.jsonl"


def restore_hypernetwork(hyper: DocToLoRA, run_dir, *, log: Callable[[str], None] | None = None
                         ) -> tuple[int, list[dict]]:
    """Load the newest good checkpoint of a :func:`train_doc_to_lora` run into ``hyper``.

    For evaluating a run that was interrupted (or is still going): nothing is trained.

    Returns:
        ``(step, curve)``: the checkpoint's step and the rows of ``run_dir/curve.jsonl`` up to
        that step (``[]`` when the run logged no evaluations).

    Raises:
        FileNotFoundError: ``run_dir`` holds no checkpoint.
    """
    from lowrank_jax.io.checkpoint import checkpoint_manager, restore_checkpoint

    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(f"run_dir={run_dir} has no checkpoints/ folder; train with "
                                "run_dir= first (or check the path).")
    _, params = nnx.split(hyper, nnx.Param)
    # the schedule's values do not enter the optimizer state's structure
    state = HyperTrainState(0, params, default_optimizer(steps=2).init(params))
    manager = checkpoint_manager(run_dir, create=False)
    try:
        state, manager = restore_checkpoint(manager, state, log=log or (lambda s: None))
    finally:
        manager.close()
    nnx.update(hyper, state.params)
    curve_path = run_dir / CURVE_NAME
    curve = []
    if curve_path.exists():
        for line in curve_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a half-written last line
                continue
            if row.get("step", 0) <= state.step:
                curve.append(row)
    return int(state.step), curve


def _batch(data: DistillData, idx) -> DistillData:
    return DistillData(*(jnp.asarray(np.asarray(x)[idx]) for x in data))


def train_doc_to_lora(hyper: DocToLoRA, model, data: DistillData, *, steps: int,
                      batch_size: int = 4, learning_rate: float = 1e-4, warmup: int = 10,
                      l1_weight: float = 0.1, seed: int = 0, run_dir=None, save_every: int = 50,
                      resume: bool = False, optimizer: optax.GradientTransformation | None = None,
                      log: Callable[[str], None] | None = None, ce_weight: float = 0.0,
                      evaluate: Callable[[DocToLoRA], dict] | None = None,
                      eval_every: int = 0) -> list[dict]:
    """Train ``hyper`` in place on ``data`` for ``steps`` steps; returns the per-step metrics.

    Only the hypernetwork's parameters get gradients: the base model's state is an input of
    the jitted step, never differentiated. Step ``t`` draws its documents from
    ``default_rng((seed, t))``, so a resumed run repeats exactly the batches an uninterrupted
    run would see.

    Args:
        hyper: the :class:`DocToLoRA` to train (updated in place).
        model: the frozen base model.
        data: :func:`build_distill_data` examples.
        steps: total optimizer steps (a resumed run continues up to it).
        batch_size: documents per step.
        learning_rate, warmup: of :func:`default_optimizer` (ignored with ``optimizer``).
        l1_weight: ``λ_1`` on the generated weights.
        seed: batch-order seed.
        run_dir: folder for ``checkpoints/`` (orbax, verified) and the final
            ``hypernetwork/``; ``None`` trains in memory.
        save_every: checkpoint period in steps.
        resume: continue from the newest good checkpoint in ``run_dir``.
        optimizer: any optax transform instead of the default.
        log: called with one line per logged step.
        ce_weight: weight of the auxiliary answer cross-entropy (see :func:`distill_loss`).
        evaluate: called every ``eval_every`` steps (and at the last step) with ``hyper``
            holding the current weights; its dict joins that step's row, together with
            ``kl_mean`` (the mean KL since the previous evaluation). With ``run_dir`` the row
            is appended to ``run_dir/curve.jsonl`` (rows after a resumed step are dropped
            first), so an interrupted run keeps its learning curve.
        eval_every: evaluation period in steps (0: never).
    """
    from lowrank_jax.hyper.export import save_hypernetwork
    from lowrank_jax.io.checkpoint import (
        checkpoint_manager,
        restore_checkpoint,
        save_checkpoint,
        truncate_metrics,
    )

    for key, value in (("steps", steps), ("batch_size", batch_size), ("save_every", save_every)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{key}={value!r} must be a positive integer.")
    if not (isinstance(eval_every, int) and eval_every >= 0):
        raise ValueError(f"eval_every={eval_every!r} must be a non-negative integer (0: never).")
    if eval_every and evaluate is None:
        raise ValueError("eval_every > 0 needs evaluate (the function to call).")
    n = len(data.queries)
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} exceeds the {n} training documents; lower it.")
    if resume and run_dir is None:
        raise ValueError("resume=True needs run_dir (where the checkpoints are).")
    tx = optimizer or default_optimizer(learning_rate, steps, warmup)
    hyper_graph, params = nnx.split(hyper, nnx.Param)
    base_graph, base_state = nnx.split(model)
    config = hyper.config

    def loss_fn(p, base_state, batch):
        bank = nnx.merge(hyper_graph, p)(batch.features, batch.mask)
        return distill_loss(bank, nnx.merge(base_graph, base_state), config, batch,
                            l1_weight=l1_weight, ce_weight=ce_weight)

    step_fn = make_step(loss_fn, tx, has_aux=True)

    state = HyperTrainState(0, params, tx.init(params))
    manager = None
    if run_dir is not None:
        run_dir = pathlib.Path(run_dir)
        manager = checkpoint_manager(run_dir)
        if not resume and manager.all_steps():
            manager.close()
            raise ValueError(f"run_dir={run_dir} already holds checkpoints (steps "
                             f"{sorted(manager.all_steps())}); pass resume=True to continue "
                             "that run, or choose another run_dir.")
        if resume and manager.all_steps():
            state, manager = restore_checkpoint(manager, state, log=log or (lambda s: None))
        truncate_metrics(run_dir / CURVE_NAME, state.step)
    history, since_eval, t_start = [], [], time.perf_counter()

    def batches(t):
        idx = np.random.default_rng((seed, t)).choice(n, batch_size, replace=False)
        return base_state, _batch(data, idx)

    for run in iterate_steps(step_fn, state.params, state.opt_state, batches, steps=steps,
                             start=state.step, what="doc-to-lora"):
        state = HyperTrainState(run.step, run.params, run.opt_state)
        loss, (kl, l1) = run.value
        row = {"step": state.step, "loss": float(loss), "kl": float(kl), "l1": float(l1)}
        history.append(row)
        since_eval.append(row["kl"])
        if eval_every and (state.step % eval_every == 0 or state.step == steps):
            nnx.update(hyper, state.params)
            row.update(kl_mean=float(np.mean(since_eval)), **evaluate(hyper))
            since_eval = []
            if run_dir is not None:
                with open(run_dir / CURVE_NAME, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if log is not None and (state.step % 10 == 0 or state.step == steps):
            log(f"step {state.step}/{steps}: loss {row['loss']:.4f} kl {row['kl']:.4f} "
                f"l1 {row['l1']:.2e} ({time.perf_counter() - t_start:.0f}s)")
        if manager is not None and (state.step % save_every == 0 or state.step == steps):
            save_checkpoint(manager, state)
    nnx.update(hyper, state.params)
    if manager is not None:
        manager.close()
        save_hypernetwork(hyper, run_dir / "hypernetwork")
    return history


def context_distiller(model, config, *, total_rank: int, steps: int = 50,
                      learning_rate: float = 1e-3, l1_weight: float = 0.0):
    """The slow baseline: per-document context distillation into a fresh LoRA.

    Returns ``distill(batch, seed=0) -> LoRABank``: a rank-``total_rank`` adapter on the
    projections of ``config`` starts from ``A ~ N(0, 1/d_in)``, ``B = 0`` and takes ``steps``
    Adam steps of :func:`distill_loss` on ``batch`` (one document's queries, ``D = 1``; its
    ``features`` are not used). The step is compiled once for every document.
    """
    tx = optax.adam(learning_rate)
    graph, state = nnx.split(model)
    n_layers = len(config.layers)

    def loss_fn(p, state, batch):
        return distill_loss(LoRABank(*p), nnx.merge(graph, state), config, batch,
                            l1_weight=l1_weight)[0]

    step_fn = make_step(loss_fn, tx)

    def distill(batch: DistillData, seed: int = 0) -> LoRABank:
        a0 = jax.random.normal(jax.random.key(seed), (1, n_layers, total_rank, config.d_in))
        params = (a0 / np.sqrt(config.d_in), jnp.zeros((1, n_layers, total_rank, config.d_out)))
        opt_state = tx.init(params)
        batch = DistillData(*(jnp.asarray(x) for x in batch))
        return LoRABank(*run_steps(step_fn, params, opt_state, lambda t: (state, batch),
                                   steps=steps, what="context distillation").params)

    return distill


__all__ = ["DistillData", "HyperTrainState", "build_distill_data", "context_distiller",
           "default_optimizer", "distill_loss", "l1_penalty", "restore_hypernetwork",
           "topk_distill", "train_doc_to_lora"]
