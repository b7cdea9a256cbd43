"""The synthetic class-incremental benchmark of the Janus-LoRA spec (its CPU demo) and the runs
of each continual method over it.

The stream: ``TASKS`` tasks of ``CLASSES_PER_TASK`` classes, inputs in ``R^D_IN`` drawn from
Gaussian clusters whose means lie in task-specific, partly overlapping ``SUB``-dimensional
subspaces (two directions shared by every task). The model: a frozen random 2-layer MLP
(``D_IN → HIDDEN → HIDDEN``, GELU) with rank-``RANK`` LoRA on both layers and a cosine classifier
whose class rows train only during their task.

Arms of :func:`run_method` (same data, steps and Adam settings):

* ``lora``      plain sequential LoRA (the forgetting baseline)
* ``joint``     all tasks' data at once (upper bound)
* ``ortho_a``   orthogonal-subspace baseline in the style of InfLoRA / LoRA-GPM: OE bases, only
  A's gradient projected (the ΔB·A term still leaks)
* ``gr_plain``  Janus GR without preconditioning + OE + clamp
* ``janus_gr``  Janus OE + GR (preconditioned) + re-anchoring + clamp
* ``dml_only``  plain LoRA + the decoupled margin loss
* ``janus``     the full method: OE + GR + DML

and of :func:`run_loda` (``loda_norecal``, ``loda``): LoDA's frozen shared / isolated
down-projections chosen per task on the merged backbone, GAO on the B factors, closed-form
recalibration of ``B_G`` and a merge after each task. Each run returns ACC and BWT
(:func:`lowrank_jax.train.continual.continual_metrics`) and its accuracy matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.core.losses import cross_entropy
from lowrank_jax.core.loop import run_steps
from lowrank_jax.core.step import make_step
from lowrank_jax.nn.lora import lora_output
from lowrank_jax.optim.janus import (
    SubspaceMemory,
    decoupled_margin_loss,
    oe_accumulate,
    oe_finalize,
    orthogonality_clamp,
    scale_by_input_projection,
    scale_by_janus,
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

D_IN, HIDDEN, RANK, TASKS, CLASSES_PER_TASK, SUB = 64, 128, 4, 5, 4, 8
SCALE, TEMP, MARGIN, DML_WEIGHT = 1.0, 10.0, 0.2, 0.5
INCREMENTAL_METHODS = ("lora", "joint", "ortho_a", "gr_plain", "janus_gr", "dml_only", "janus")
LODA_METHODS = ("loda_norecal", "loda")
LAYERS = ("l1", "l2")


def make_stream(seed: int, n_per_class: int = 60):
    """The stream of one seed: per task ``((x_train, y_train), (x_test, y_test))``.

    Each class has ``2 · n_per_class`` points, half for training and half for testing; labels
    run over ``0 .. TASKS · CLASSES_PER_TASK - 1`` (task ``t`` owns ``CLASSES_PER_TASK`` of them).

    Example::

        >>> (x, y), (x_test, _) = make_stream(0, n_per_class=5)[1]
        >>> x.shape, sorted(set(y.tolist())), x_test.shape
        ((20, 64), [4, 5, 6, 7], (20, 64))
    """
    rng = np.random.default_rng(seed)
    shared = np.linalg.qr(rng.normal(size=(D_IN, 4)))[0]
    data = []
    for t in range(TASKS):
        own = np.linalg.qr(rng.normal(size=(D_IN, SUB - 2)))[0]
        basis = np.linalg.qr(np.concatenate([own, shared[:, :2]], 1))[0]  # partly overlapping
        xs, ys = [], []
        for c in range(CLASSES_PER_TASK):
            mean = basis @ rng.normal(scale=3.0, size=SUB)
            x = mean[:, None] + basis @ rng.normal(scale=1.0, size=(SUB, 2 * n_per_class))
            xs.append(x.T)
            ys.append(np.full(2 * n_per_class, t * CLASSES_PER_TASK + c))
        x, y = np.concatenate(xs).astype(np.float32), np.concatenate(ys)
        perm = rng.permutation(len(y))
        x, y = x[perm], y[perm]
        half = len(y) // 2
        data.append(((x[:half], y[:half]), (x[half:], y[half:])))
    return data


def init_params(seed: int):
    """The model's parameters: frozen kernels and LoRA factors (``lora_b = 0``) of layers
    ``l1`` and ``l2``, and the classifier's rows (``head``, one per class)."""
    k = jax.random.split(jax.random.key(seed + 1000), 6)
    n_classes = TASKS * CLASSES_PER_TASK
    return {
        "l1": {"kernel": jax.random.normal(k[0], (D_IN, HIDDEN)) / np.sqrt(D_IN),
               "lora_a": jax.random.normal(k[1], (D_IN, RANK)) / np.sqrt(D_IN),
               "lora_b": jnp.zeros((RANK, HIDDEN))},
        "l2": {"kernel": jax.random.normal(k[2], (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN),
               "lora_a": jax.random.normal(k[3], (HIDDEN, RANK)) / np.sqrt(HIDDEN),
               "lora_b": jnp.zeros((RANK, HIDDEN))},
        "head": jax.random.normal(k[4], (n_classes, HIDDEN)) * 0.1,
    }


def layer(p, x):
    """One adapted linear layer: ``x W + SCALE · (x A) B``."""
    return x @ p["kernel"] + lora_output(x, p["lora_a"], p["lora_b"], SCALE)


def features(params, x):
    """``(h1, h2)``: the GELU outputs of both layers (``h1`` is the second layer's input)."""
    h1 = jax.nn.gelu(layer(params["l1"], x))
    return h1, jax.nn.gelu(layer(params["l2"], h1))


def logits_fn(params, x, seen_mask):
    """Cosine-classifier logits ``TEMP · cos(h2, head_c)``; classes outside ``seen_mask`` get
    ``-1e9``."""
    _, f = features(params, x)
    f = f / (jnp.linalg.norm(f, axis=-1, keepdims=True) + 1e-6)
    w = params["head"] / (jnp.linalg.norm(params["head"], axis=-1, keepdims=True) + 1e-6)
    return jnp.where(seen_mask, TEMP * f @ w.T, -1e9)


def run_method(method: str, data, seed: int, steps: int, lr: float, batch: int):
    """One run of a LoRA arm (see :data:`INCREMENTAL_METHODS`) over the stream ``data``.

    ``steps`` Adam steps of batch ``batch`` per task (``joint``: per task, on all tasks at
    once). Returns ``{"acc", "bwt", "matrix", "violation_l1"}``: ACC, BWT (NaN for ``joint``),
    the accuracy matrix and the mean first-layer null-space violation
    ``‖ΔW X_past‖ / ‖X_past‖`` over the tasks after the first.
    """
    params = init_params(seed)
    n_classes = TASKS * CLASSES_PER_TASK
    memories = {"l1": SubspaceMemory.empty(D_IN), "l2": SubspaceMemory.empty(HIDDEN)}
    thresholds = {"l1": 1 - 1e-6, "l2": 0.97}
    protect = method in ("ortho_a", "gr_plain", "janus_gr", "janus")
    use_dml = method in ("dml_only", "janus")
    if method == "ortho_a":
        tx = with_subspaces(optax.chain(scale_by_input_projection(), optax.adam(lr)))
    elif protect:
        tx = with_subspaces(optax.chain(
            scale_by_janus(SCALE, precondition=method != "gr_plain"), optax.adam(lr),
            orthogonality_clamp()))
    else:
        tx = optax.adam(lr)
    acc = np.zeros((TASKS, TASKS))
    prototypes = np.zeros((0, HIDDEN), np.float32)
    past_inputs = []
    violation = []

    def loss_fn(p, x, y, current, protos):
        # frozen kernels; a class's head row trains only during its task (zero gradient else)
        p = {**{k: {**p[k], "kernel": jax.lax.stop_gradient(p[k]["kernel"])} for k in memories},
             "head": jnp.where(current[:, None], p["head"], jax.lax.stop_gradient(p["head"]))}
        ce = cross_entropy(logits_fn(p, x, current), y)
        if use_dml:
            _, f = features(p, x)
            ce = ce + DML_WEIGHT * decoupled_margin_loss(f, y, protos, p["head"], margin=MARGIN)
        return ce

    step = make_step(loss_fn, tx)

    @jax.jit
    def accuracy(p, x, y, seen):
        return jnp.mean(jnp.argmax(logits_fn(p, x, seen), -1) == y)

    task_list = [list(range(TASKS))] if method == "joint" else [[t] for t in range(TASKS)]
    rng = np.random.default_rng(seed)
    for stage, tasks in enumerate(task_list):
        x_tr = np.concatenate([data[t][0][0] for t in tasks])
        y_tr = np.concatenate([data[t][0][1] for t in tasks])
        last = tasks[-1]
        seen = np.arange(n_classes) < (last + 1) * CLASSES_PER_TASK
        current = np.zeros(n_classes, bool)
        for t in tasks:
            current[t * CLASSES_PER_TASK:(t + 1) * CLASSES_PER_TASK] = True
        if method == "joint":
            current = seen
        bases = {k: m.basis for k, m in memories.items()}
        if protect and stage > 0:  # re-anchor: move a's protected part into the frozen kernel
            for name in ("l1", "l2"):
                v, q = bases[name], params[name]
                protected = v @ (v.T @ q["lora_a"])
                params[name] = {**q, "kernel": q["kernel"] + SCALE * protected @ q["lora_b"],
                                "lora_a": q["lora_a"] - protected}
        opt = tx.init(params)
        if protect:
            opt = set_subspaces(opt, bases)
        before = jax.tree.map(jnp.array, params)
        protos = jnp.asarray(prototypes) if len(prototypes) else jnp.zeros((1, HIDDEN))
        def batches(t, x_tr=x_tr, y_tr=y_tr, current=current, protos=protos):
            idx = rng.integers(0, len(y_tr), batch)
            return x_tr[idx], y_tr[idx], current, protos

        params = run_steps(step, params, opt, batches, steps=steps * len(tasks),
                           what=method).params
        # first-layer violation on past inputs
        if past_inputs:
            xp = np.concatenate(past_inputs)
            dw = (params["l1"]["kernel"] + SCALE * params["l1"]["lora_a"] @ params["l1"]["lora_b"]
                  - before["l1"]["kernel"]
                  - SCALE * before["l1"]["lora_a"] @ before["l1"]["lora_b"])
            violation.append(float(jnp.linalg.norm(xp @ dw) / jnp.linalg.norm(xp)))
        # task end: OE on the layer inputs, prototypes, evaluation
        for t in tasks:
            x_t = data[t][0][0]
            h1, f = features(params, x_t)
            memories["l1"] = oe_accumulate(memories["l1"], jnp.asarray(x_t))
            memories["l2"] = oe_accumulate(memories["l2"], h1)
            f = np.asarray(f / (jnp.linalg.norm(f, axis=-1, keepdims=True) + 1e-6))
            for c in range(t * CLASSES_PER_TASK, (t + 1) * CLASSES_PER_TASK):
                prototypes = np.concatenate([prototypes, f[data[t][0][1] == c].mean(0)[None]])
            past_inputs.append(x_t)
        for name in memories:
            memories[name] = oe_finalize(memories[name], thresholds[name])
        for j in range(last + 1):
            acc[last if method != "joint" else TASKS - 1, j] = float(
                accuracy(params, data[j][1][0], data[j][1][1], seen))
    metrics = continual_metrics(acc)
    avg_acc = metrics.acc
    bwt = metrics.bwt if method != "joint" else float("nan")
    return {"acc": avg_acc, "bwt": bwt, "matrix": acc.tolist(),
            "violation_l1": float(np.mean(violation)) if violation else float("nan")}


def run_loda(data, seed: int, steps: int, lr: float, gao_lr: float, batch: int, *, k_g: int,
             k_i: int, old_energy: float, lam: float, recal: bool, gao_adam: bool = False):
    """One LoDA run over the stream; returns ACC, BWT, the accuracy matrix and diagnostics."""
    params = init_params(seed)
    n_classes = TASKS * CLASSES_PER_TASK
    dims = {"l1": D_IN, "l2": HIDDEN}
    kernels = {n: params[n]["kernel"] for n in LAYERS}
    head = params["head"]
    memory = {n: CovStat(jnp.zeros((dims[n], dims[n])), jnp.int32(0)) for n in LAYERS}
    tx_b = gao(gao_lr, momentum=0.9, adam=gao_adam)
    tx_head = optax.adam(lr)
    decomp = jax.jit(decompose, static_argnames=("k_g", "k_i", "old_energy"))

    def as_base_params(kern, frozen, trainable, hd):
        """The layout of :func:`init_params`: lora_a = [A_Gᵀ A_Iᵀ], lora_b = [B_G; B_I]."""
        out = {"head": hd}
        for n in LAYERS:
            out[n] = {"kernel": kern[n],
                      "lora_a": jnp.concatenate([frozen[n]["a_g"].T, frozen[n]["a_i"].T], 1),
                      "lora_b": jnp.concatenate([trainable[n]["b_g"], trainable[n]["b_i"]], 0)}
        return out

    # B factors (GAO) and the head (Adam) in one step; a head row trains only during its task
    tx = optax.partition({"b": tx_b, "head": tx_head}, {"b": "b", "head": "head"})

    def loss_fn(p, kern, frozen, x, y, current):
        hd = jnp.where(current[:, None], p["head"], jax.lax.stop_gradient(p["head"]))
        return cross_entropy(logits_fn(as_base_params(kern, frozen, p["b"], hd), x, current),
                             y)

    step = make_step(loss_fn, tx)

    @jax.jit
    def accuracy(kern, hd, x, y, seen):
        p = {"head": hd, **{n: {"kernel": kern[n], "lora_a": jnp.zeros((dims[n], 1)),
                                "lora_b": jnp.zeros((1, HIDDEN))} for n in LAYERS}}
        return jnp.mean(jnp.argmax(logits_fn(p, x, seen), -1) == y)

    def merged_inputs(x):
        p = {n: {"kernel": kernels[n], "lora_a": jnp.zeros((dims[n], 1)),
                 "lora_b": jnp.zeros((1, HIDDEN))} for n in LAYERS}
        h1, _ = features(p, x)
        return {"l1": x, "l2": h1}

    acc = np.zeros((TASKS, TASKS))
    diag = []
    rng = np.random.default_rng(seed)
    for t in range(TASKS):
        x_tr, y_tr = data[t][0]
        seen = np.arange(n_classes) < (t + 1) * CLASSES_PER_TASK
        current = np.zeros(n_classes, bool)
        current[t * CLASSES_PER_TASK:(t + 1) * CLASSES_PER_TASK] = True
        # statistics on the current merged backbone, then the task-driven decomposition
        inputs = merged_inputs(jnp.asarray(x_tr))
        stats = {n: feature_stats(inputs[n]) for n in LAYERS}
        frozen, info = {}, {}
        for n in LAYERS:
            sub = decomp(stats[n].c, memory[n].c, k_g=k_g, k_i=k_i, old_energy=old_energy)
            frozen[n] = {"a_g": sub.a_g, "a_i": sub.a_i}
            info[n] = {"old_rank": int(sub.old_rank), "E_new_G": float(sub.energy_new_g),
                       "E_new_I": float(sub.energy_new_i), "E_old_I": float(sub.energy_old_i)}
        trainable = {n: {"b_g": jnp.zeros((k_g, HIDDEN)),
                         "b_i": jnp.zeros((k_i, HIDDEN))} for n in LAYERS}
        p = {"b": trainable, "head": head}
        opt = tx.init(p)
        def batches(t, x_tr=x_tr, y_tr=y_tr, frozen=frozen, current=current):
            idx = rng.integers(0, len(y_tr), batch)
            return kernels, frozen, x_tr[idx], y_tr[idx], current

        p = run_steps(step, p, opt, batches, steps=steps, what="loda").params
        trainable, head = p["b"], p["head"]
        # recalibrate (before merging and before updating the memory), merge, update memory
        for n in LAYERS:
            b_g = trainable[n]["b_g"]
            if recal:
                b_g = recalibrate(b_g, frozen[n]["a_g"], stats[n].c, memory[n].c, lam=lam)
            info[n]["B_G_shrink"] = float(jnp.linalg.norm(b_g)
                                          / (jnp.linalg.norm(trainable[n]["b_g"]) + 1e-12))
            kernels[n] = merge(kernels[n], frozen[n]["a_g"], b_g, frozen[n]["a_i"],
                               trainable[n]["b_i"], SCALE)
            memory[n] = update_memory(memory[n], stats[n])
        diag.append(info)
        for j in range(t + 1):
            acc[t, j] = float(accuracy(kernels, head, data[j][1][0], data[j][1][1], seen))
    final = acc[TASKS - 1]
    bwt = float(np.mean([final[j] - acc[j, j] for j in range(TASKS - 1)]))
    return {"acc": float(final.mean()), "bwt": bwt, "matrix": acc.tolist(), "diagnostics": diag}


__all__ = ["CLASSES_PER_TASK", "D_IN", "HIDDEN", "INCREMENTAL_METHODS", "LODA_METHODS", "RANK",
           "TASKS",
           "features", "init_params", "logits_fn", "make_stream", "run_loda", "run_method"]
