"""Continual LoRA on a language model: one adapter method trained over a stream of text tasks.

:func:`run_continual_lora` trains a rank-``r`` LoRA on the projections ``pattern`` names, task
after task, the same number of steps each, and after each task scores every task's held-out
windows (:func:`~lowrank_jax.train.losses.window_evaluator`: NLL and next-token accuracy),
giving ``R[i, j]`` and its ACC / BWT / FWT (:func:`~lowrank_jax.train.continual.continual_metrics`).
Methods (the same rank, steps, batch and learning rate):

* ``lora``  — one adapter trained on task after task (the forgetting baseline);
* ``olora`` — O-LoRA style: a fresh adapter per task, the previous ones merged and frozen, and
  ``λ Σ |A_oldᵀ A_new|`` (:func:`olora_penalty`) keeping the new ``A`` orthogonal to the old
  ones (Wang et al. 2023);
* ``janus`` — Janus-LoRA GR + clamp (:func:`lowrank_jax.optim.janus.janus`) with the protected
  input bases from online estimation and re-anchoring at each task start;
* ``loda``  — LoDA (:mod:`lowrank_jax.optim.loda`): frozen ``A_G`` / ``A_I`` of ``rank/2`` each
  from the energy decomposition, ``B`` trained with GAO, closed-form recalibration of ``B_G``,
  merged after each task.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowrank_jax.core.step import make_step
from lowrank_jax.nn import LoRARule, apply_lora, lora_layers
from lowrank_jax.nn.init import capture_layer_inputs
from lowrank_jax.nn.lora import default_a_initializer
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    janus,
    oe_accumulate,
    oe_finalize,
    reanchor,
    set_subspaces,
    with_subspaces,
)
from lowrank_jax.optim.loda import (
    CovStat,
    decompose,
    feature_stats,
    gao,
    merge,
    recalibrate,
    update_memory,
)
from lowrank_jax.train.continual import continual_metrics
from lowrank_jax.train.losses import adapter_loss, window_evaluator
from lowrank_jax.train.loop import train_windows

PATTERN = r"self_attn/(q_proj|v_proj)$"
CONTINUAL_METHODS = ("lora", "olora", "janus", "loda")


@dataclasses.dataclass(frozen=True)
class ContinualLoRAConfig:
    """The settings every method shares (``lr``: Adam, for lora / olora / janus)."""

    rank: int = 8
    steps: int = 40
    batch: int = 4
    lr: float = 2e-3
    gao_lr: float = 0.1
    olora_lambda: float = 0.5
    janus_threshold: float = 0.97
    loda_old_energy: float = 0.97
    loda_lambda: float = 1.0
    stat_windows: int = 32
    pattern: str = PATTERN


def q_path(path: str) -> str:
    """q_proj and v_proj read the same normalised hidden state: capture it once at q_proj.

    Example::

        >>> q_path("layers/3/self_attn/v_proj")
        'layers/3/self_attn/q_proj'
    """
    return path.replace("v_proj", "q_proj")


def layer_inputs(model, paths: Sequence[str], windows, batch: int = 8) -> dict:
    """``{path: [tokens, d]}`` inputs of the LoRA projections ``paths`` over ``windows [n, t+1]``
    (their first ``t`` tokens), ``batch`` windows per forward."""
    return capture_layer_inputs(model, lambda m: [m(jnp.asarray(windows[i:i + batch, :-1]))
                                                  for i in range(0, len(windows), batch)], paths)


def leaf_key(path) -> str:
    """The ``jax.tree_util.keystr`` of a key path (a leaf's name in a flattened state)."""
    return jax.tree_util.keystr(path)


def layer_key(path: str) -> str:
    """``layers/3/self_attn/q_proj`` → the fragment of its leaf keystr (``[3]...['q_proj']``).

    Example::

        >>> layer_key("layers/3/self_attn/q_proj")
        "[3]['self_attn']['q_proj']"
    """
    parts = path.split("/")
    return f"[{parts[1]}]['{parts[2]}']['{parts[3]}']"


def olora_penalty(weight: float) -> Callable:
    """``penalty(lora, olds) = weight · Σ |A_oldᵀ A|``: every ``lora_a`` leaf of ``lora``
    against the frozen ``A`` of the earlier tasks in ``olds`` (``{leaf_key: [d_in, r_old]}``).

    Example::

        >>> import jax.numpy as jnp
        >>> lora = {"lora_a": jnp.ones((2, 1))}
        >>> float(olora_penalty(0.5)(lora, {"['lora_a']": jnp.ones((2, 1))}))
        1.0
    """

    def penalty(lora, olds):
        total = 0.0
        for path, a in jax.tree_util.tree_flatten_with_path(lora)[0]:
            if leaf_key(path) in olds:
                total = total + jnp.sum(jnp.abs(olds[leaf_key(path)].T @ a))
        return weight * total

    return penalty


def run_continual_lora(load_model: Callable[[], nnx.Module], method: str, tasks, *, seed: int,
                       config: ContinualLoRAConfig, baseline: dict, log=print) -> dict:
    """Train ``method`` over ``tasks`` (:class:`~lowrank_jax.data.continual_text.TextTask`, in
    order) on a fresh ``load_model()``; score every task after each one.

    Args:
        load_model: builds the base model (called once).
        method: one of :data:`CONTINUAL_METHODS`.
        tasks: the stream; each task's ``train`` windows are sampled ``config.batch`` at a
            time (``numpy`` generator seeded by ``seed``), its ``heldout`` windows scored.
        seed: the adapters' initialisation and the batches.
        baseline: ``{"nll": [...], "acc": [...]}`` of the untouched model per task (FWT).
        log: a line after each task.

    Returns:
        ``acc``, ``bwt``, ``fwt`` (next-token accuracy in points), ``final_nll``, ``bwt_nll``
        (NLL forgetting, nats), the ``acc_matrix`` / ``nll_matrix`` ``R[i, j]``, the per-task
        training ``losses`` and ``janus_basis_rank`` (the mean protected rank after each task).
    """
    cfg = config
    model = load_model()
    apply_lora(model, LoRARule(cfg.pattern, rank=cfg.rank), rngs=nnx.Rngs(seed))
    layers = dict(lora_layers(model))
    q_paths = sorted({q_path(p) for p in layers})
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    evaluate = window_evaluator(graphdef)
    scale = next(iter(layers.values())).scaling
    d_in = next(iter(layers.values())).in_features
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed + 7)
    half = cfg.rank // 2

    extra_loss = olora_penalty(cfg.olora_lambda) if method == "olora" else None
    if method == "loda":
        frozen_a = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731  A_G, A_I frozen
            lambda p, _: "lora_a" in leaf_key(p), tree)
        tx = optax.chain(optax.masked(optax.set_to_zero(), frozen_a),
                         gao(cfg.gao_lr, momentum=0.9))
    elif method == "janus":
        tx = with_subspaces(janus(cfg.lr, scale))
    else:
        tx = optax.adam(cfg.lr)
    step = make_step(adapter_loss(graphdef, extra_loss), tx)

    memories = {p: SubspaceMemory.empty(d_in) for p in q_paths}
    loda_memory = {p: CovStat(jnp.zeros((d_in, d_in)), jnp.int32(0)) for p in q_paths}
    olds: dict[str, jnp.ndarray] = {}
    n = len(tasks)
    acc, nll = np.zeros((n, n)), np.zeros((n, n))
    info = {"janus_basis_rank": [], "losses": []}
    for t, task in enumerate(tasks):
        subspaces = None
        stats = None
        if method == "janus":
            if t > 0:
                for p, layer in layers.items():
                    reanchor(layer, memories[q_path(p)].basis)
            subspaces = {p: memories[q_path(p)].basis for p in layers}
        if method == "loda":
            inputs = layer_inputs(model, q_paths, task.train[:cfg.stat_windows])
            stats = {p: feature_stats(x) for p, x in inputs.items()}
            subs = {p: decompose(stats[p].c, loda_memory[p].c, k_g=half, k_i=cfg.rank - half,
                                 old_energy=cfg.loda_old_energy) for p in q_paths}
            for p, layer in layers.items():
                sub = subs[q_path(p)]
                layer.lora_a[...] = jnp.concatenate([sub.a_g.T, sub.a_i.T], 1)
                layer.lora_b[...] = jnp.zeros_like(layer.lora_b[...])
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        if method == "olora":
            a_keys = [leaf_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(lora)[0]
                      if "lora_a" in leaf_key(p)]
            extra = (dict(olds),) if olds else ({k: jnp.zeros((d_in, 1)) for k in a_keys},)
        else:
            extra = ()
        opt = tx.init(lora)
        if subspaces is not None:
            opt = set_subspaces(opt, subspaces)
        lora, _, losses, _ = train_windows(
            lambda lora, opt, batch: step(lora, opt, rest, batch, *extra), lora, opt,
            task.train, steps=cfg.steps, batch_size=cfg.batch, rng=rng)
        info["losses"].append(losses)
        nnx.update(model, lora)
        # task end: method bookkeeping on the model's layers
        if method == "janus":
            inputs = layer_inputs(model, q_paths, task.train[:cfg.stat_windows])
            for p in q_paths:
                memories[p] = oe_finalize(oe_accumulate(memories[p], inputs[p]),
                                          cfg.janus_threshold)
            info["janus_basis_rank"].append(int(np.mean([int(m.rank)
                                                         for m in memories.values()])))
        if method == "loda":
            for p, layer in layers.items():
                qp = q_path(p)
                sub = subs[qp]
                b = layer.lora_b[...]
                b_g = recalibrate(b[:half], sub.a_g, stats[qp].c, loda_memory[qp].c,
                                  lam=cfg.loda_lambda)
                layer.kernel[...] = merge(layer.kernel[...], sub.a_g, b_g, sub.a_i, b[half:],
                                          layer.scaling)
                layer.lora_b[...] = jnp.zeros_like(b)
            for p in q_paths:
                loda_memory[p] = update_memory(loda_memory[p], stats[p])
        if method == "olora":
            graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
            flat = {leaf_key(p): None for p, _ in jax.tree_util.tree_flatten_with_path(lora)[0]}
            for p, layer in layers.items():
                layer.kernel[...] = layer.kernel[...] + layer.delta()
                k = next(k for k in flat if "lora_a" in k and layer_key(p) in k)
                a = layer.lora_a[...]
                olds[k] = a if k not in olds else jnp.concatenate([olds[k], a], 1)
                key, sub_key = jax.random.split(key)
                layer.lora_a[...] = default_a_initializer(sub_key, a.shape, a.dtype)
                layer.lora_b[...] = jnp.zeros_like(layer.lora_b[...])
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        for j, other in enumerate(tasks):
            nll[t, j], acc[t, j] = evaluate(lora, rest, other.heldout)
        log(f"  [{time.strftime('%H:%M:%S')}] {method} seed {seed} after {task.name}: "
            f"acc {np.round(acc[t] * 100, 2)} "
            f"nll {np.round(nll[t], 3)} (train loss {np.mean(losses[-5:]):.3f})")
    m = continual_metrics(acc * 100, np.asarray(baseline["acc"]) * 100)
    m_nll = continual_metrics(-nll, -np.asarray(baseline["nll"]))
    return {"acc": m.acc, "bwt": m.bwt, "fwt": m.fwt, "final_nll": float(nll[-1].mean()),
            "bwt_nll": -m_nll.bwt, "acc_matrix": acc.tolist(), "nll_matrix": nll.tolist(),
            **info}


__all__ = ["CONTINUAL_METHODS", "PATTERN", "ContinualLoRAConfig", "layer_inputs", "layer_key",
           "leaf_key", "olora_penalty", "q_path", "run_continual_lora"]
