"""Data-parallel training of ``M`` workers simulated on one host: DDP and LoRDO.

Both simulations read one batch per worker and step ``t`` from ``batches(t) -> (x, y)``, each of
shape ``[M, ...]`` (worker ``m`` reads row ``m``), and score with ``loss_fn(params, x, y)``; the
update is the package's one step (:func:`lowrank_jax.core.step.make_step`).

- :func:`simulate_ddp`: every step all-reduces (averages) the workers' gradients and applies
  one shared update: ``g_t = (1/M) Σ_m ∇L(θ_t; batch_{t,m})``.
- :func:`simulate_lordo`: every worker takes ``period`` local steps of its own optimizer (a
  :func:`lowrank_jax.optim.lordo` chain), then :func:`lowrank_jax.optim.lordo_sync` averages the
  displacements, moves the anchor with ``outer`` and rebuilds the global projection; with a
  ``mesh`` the workers are sharded over its ``data`` axis and the sync runs under
  ``shard_map`` (one ``pmean``), without one they are vmapped on one device (same math).

Both count the floats each worker sends (what enters the collectives).

References:
    Jovanović et al., `LoRDO: Distributed Low-Rank Optimization with Infrequent Communication
    <https://arxiv.org/abs/2602.04396>`_, ICML 2026.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax.core.loop import iterate_steps, run_steps
from lowrank_jax.core.step import make_step
from lowrank_jax.optim.lordo import find_lordo_state
from lowrank_jax.optim.lordo_distributed import communication_per_sync, lordo_sync, set_projection

Batches = Callable[[int], tuple[Any, Any]]


def simulate_ddp(tx: optax.GradientTransformation, params, loss_fn: Callable, batches: Batches,
                 *, steps: int) -> tuple[Any, dict]:
    """``steps`` DDP steps: the mean of the workers' gradients, one shared ``tx`` update.

    Args:
        tx: the (shared) optimizer.
        params: the initial parameters (any pytree).
        loss_fn: ``loss_fn(params, x, y) -> scalar`` on one worker's batch.
        batches: ``batches(t) -> (x, y)``, each ``[M, ...]``: one batch per worker.
        steps: how many steps.

    Returns:
        ``(params, {"floats_per_worker", "syncs"})``: one all-reduce of ``|θ|`` floats a step.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> loss = lambda w, x, y: jnp.mean((x * w - y) ** 2)
        >>> batches = lambda t: (jnp.ones((2, 3)), jnp.stack([jnp.zeros(3), 2 * jnp.ones(3)]))
        >>> w, info = simulate_ddp(optax.sgd(0.25), jnp.zeros(()), loss, batches, steps=1)
        >>> float(w), info["syncs"]
        (0.5, 1)
    """
    # mean over workers of each worker's loss: its gradient is the all-reduced mean gradient
    step = make_step(lambda p, x, y: jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0, 0))(p, x, y)),
                     tx)
    params = run_steps(step, params, tx.init(params), batches, steps=steps, what="ddp").params
    return params, {"floats_per_worker": communication_per_sync(params) * steps, "syncs": steps}


def _principal_sines(before, after) -> float:
    """The largest principal-angle sine between old and new projections (worker 0)."""
    sines = [float(np.linalg.norm(qn[0] - qo[0] @ (qo[0].T @ qn[0]), ord=2))
             for qo, qn in zip(map(np.asarray, jax.tree.leaves(before)),
                               map(np.asarray, jax.tree.leaves(after)))
             if qo.ndim == 3]
    return max(sines)


def simulate_lordo(tx: optax.GradientTransformation, params, loss_fn: Callable,
                   batches: Batches, *, steps: int, period: int,
                   outer: optax.GradientTransformation, workers: int, mesh=None,
                   clip_norm: float = 1.0) -> tuple[Any, dict]:
    """``steps`` local steps per worker, a :func:`lordo_sync` every ``period`` (and at the end).

    Step 0 sets the first global projection from the workers' (clipped, all-reduced)
    gradients (:func:`set_projection`), so ``tx`` should be built with
    ``first_projection="set"``.

    Args:
        tx: each worker's :func:`lowrank_jax.optim.lordo` optimizer.
        params: the initial (anchor) parameters.
        loss_fn: ``loss_fn(params, x, y) -> scalar`` on one worker's batch.
        batches: ``batches(t) -> (x, y)``, each ``[workers, ...]``.
        steps: local steps per worker.
        period: local steps between syncs (``K``).
        outer: the outer step on the averaged displacement
            (:func:`lowrank_jax.optim.outer_average`, :func:`lowrank_jax.optim.outer_nesterov`).
        workers: ``M``.
        mesh: a mesh with a ``data`` axis of ``workers`` devices (one worker per device), or
            ``None`` (all workers on one device).
        clip_norm: global-norm clip of the gradients that set the first projection.

    Returns:
        ``(anchor, info)``; ``info`` has ``floats_per_worker``, ``syncs`` and the largest
        principal-angle sine between consecutive global subspaces at the first and last sync.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from lowrank_jax.optim import lordo, outer_average
        >>> loss = lambda w, x, y: jnp.mean((x @ w["k"] - y) ** 2)
        >>> x = jax.random.normal(jax.random.key(0), (2, 4, 8))
        >>> batches = lambda t: (x, jnp.zeros((2, 4, 8)))
        >>> tx = lordo(1e-2, rank=2, min_dim_for_lowrank=4, first_projection="set")
        >>> w, info = simulate_lordo(tx, {"k": jnp.eye(8)}, loss, batches, steps=4, period=2,
        ...                          outer=outer_average(), workers=2)
        >>> info["syncs"], w["k"].shape
        (2, (8, 8))
    """
    on_workers = NamedSharding(mesh, P("data")) if mesh is not None else jax.devices()[0]
    stack = lambda t: jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * workers), t),
                                     on_workers)
    worker_params = stack(params)
    anchor = params if mesh is None else jax.device_put(params, NamedSharding(mesh, P()))
    states = jax.jit(jax.vmap(tx.init))(worker_params)
    put = lambda t: jax.device_put(batches(t), on_workers)

    # Step 0: Q_0 from the all-reduced gradient (one extra all-reduce of the low-rank leaves).
    grad_fn = jax.vmap(jax.grad(loss_fn))
    clip = jax.vmap(lambda g: optax.clip_by_global_norm(clip_norm).update(
        g, optax.EmptyState())[0])
    grads0 = jax.jit(lambda w, x, y: clip(grad_fn(w, x, y)))(worker_params, *put(0))
    states, floats = jax.jit(lambda s, g: set_projection(s, g, stacked=True))(states, grads0)
    floats = int(floats)

    local = jax.jit(jax.vmap(make_step(loss_fn, tx, jit=False)))
    outer_state = outer.init(anchor)  # carried across syncs (Nesterov momentum)

    def sync_body(w, a, s, o, axis_name="data"):
        res = lordo_sync(w, a, s, outer=outer, outer_state=o, axis_name=axis_name)
        return (res.anchor, res.worker_params, res.worker_opt_states, res.outer_state,
                res.floats_sent)

    specs = lambda tree, spec: jax.tree.map(lambda _: spec, tree)
    sync = jax.jit(lambda w, a, s, o: sync_body(w, a, s, o, axis_name=None))
    if mesh is not None:
        outer_state = jax.device_put(outer_state, NamedSharding(mesh, P()))
        sync = jax.jit(jax.shard_map(
            sync_body, mesh=mesh,
            in_specs=(specs(worker_params, P("data")), specs(anchor, P()),
                      specs(states, P("data")), specs(outer_state, P())),
            out_specs=(specs(anchor, P()), specs(worker_params, P("data")),
                       specs(states, P("data")), specs(outer_state, P()), P())))
    angles, syncs = [], 0
    for run in iterate_steps(local, worker_params, states, put, steps=steps, what="lordo"):
        if run.step % period == 0 or run.step == steps:  # the sync replaces the loop's state
            before = find_lordo_state(run.opt_state).projection
            anchor, run.params, run.opt_state, outer_state, sent = sync(
                run.params, anchor, run.opt_state, outer_state)
            angles.append(_principal_sines(before, find_lordo_state(run.opt_state).projection))
            floats += int(sent)
            syncs += 1
    return anchor, {"floats_per_worker": floats, "syncs": syncs,
                    "max_subspace_sine_first_sync": angles[0],
                    "max_subspace_sine_last_sync": angles[-1]}


__all__ = ["simulate_ddp", "simulate_lordo"]
