"""LoRDO's synchronisation: one all-reduce of displacements, a new global projection, transport.

Runs every ``K`` local steps of :func:`lowrank_jax.optim.lordo.scale_by_lordo` on every worker;
pure, so it jits, vmaps, and runs under ``shard_map`` over the mesh's data axis
(``axis_name="data"``), where the only collective is one ``pmean`` of ``|θ|`` floats.

The same call runs unchanged when the data axis spans processes: after
``jax.distributed.initialize``, build the mesh over the global ``jax.devices()``, give each
process's workers as global arrays (``jax.make_array_from_process_local_data``) and ``shard_map``
the sync over ``"data"``; ``pmean`` is then the cross-process all-reduce
(``tests/optim/test_lordo_multiprocess.py``: 2 processes x 4 CPU devices, gloo).

References:
    Jovanović et al., `LoRDO: Distributed Low-Rank Optimization with Infrequent Communication
    <https://arxiv.org/abs/2602.04396>`_, ICML 2026.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.core.sharding import place_like
from lowrank_jax.optim.factors import normalize_path
from lowrank_jax.optim.linalg import Numeric
from lowrank_jax.optim.lordo import (
    ScaleByLordoState,
    is_lordo_state,
    transport_moments,
    top_subspace,
)


def outer_average() -> optax.GradientTransformation:
    """Plain averaging: the anchor moves by the mean displacement (outer lr 1, no momentum)."""
    return optax.scale(-1.0)  # receives the pseudo-gradient −Δ, so the update is +Δ


def outer_nesterov(lr: Numeric = 0.7,
                   momentum: Numeric = 0.9) -> optax.GradientTransformation:
    """DiLoCo's outer step: Nesterov SGD on the pseudo-gradient ``−Δ``."""
    return optax.sgd(lr, momentum=momentum, nesterov=True)


def _flat_by_path(tree) -> dict:
    return {normalize_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _map_lordo_states(fn, opt_states):
    return jax.tree.map(lambda s: fn(s) if is_lordo_state(s) else s, opt_states,
                        is_leaf=is_lordo_state)


def _reproject(state: ScaleByLordoState, sources: dict, transport: str, *, stacked: bool):
    """New ``Q`` per low-rank leaf from ``sources[path]`` and moments transported into it."""
    flat_q = jax.tree_util.tree_flatten_with_path(state.projection)
    mu_leaves = jax.tree.leaves(state.mu)
    nu_leaves = jax.tree.leaves(state.nu)
    new_q, new_mu, new_nu = [], [], []
    for (path, q), u, v in zip(flat_q[0], mu_leaves, nu_leaves):
        if q.ndim != (3 if stacked else 2):
            new_q.append(q), new_mu.append(u), new_nu.append(v)
            continue
        src = sources[normalize_path(path)]
        small, r = q.shape[-2:]
        if src.shape[-2] != small:  # right projection: the source is stored [p, q], p > q
            src = jnp.swapaxes(src, -1, -2)
        top = lambda s, r=r: top_subspace(s, r)
        q_new = (jax.vmap(top)(src) if src.ndim == 3 else top(src))
        if stacked and q_new.ndim == 2:
            q_new = jnp.broadcast_to(q_new, q.shape)
        q_new = place_like(q_new.astype(q.dtype), q)
        if transport == "rotate":
            tr = jax.vmap(transport_moments) if stacked else transport_moments
            u_t, v_t = tr(u.astype(jnp.float32), v, q_new, q)
        else:
            u_t, v_t = jnp.zeros_like(u, dtype=jnp.float32), jnp.zeros_like(v)
        new_q.append(q_new)
        new_mu.append(place_like(u_t.astype(u.dtype), u))
        new_nu.append(place_like(v_t, v))
    unflat = lambda ref, leaves: jax.tree.unflatten(jax.tree.structure(ref), leaves)
    updated = state._replace(projection=unflat(state.projection, new_q),
                             mu=unflat(state.mu, new_mu), nu=unflat(state.nu, new_nu),
                             needs_projection=jnp.zeros_like(state.needs_projection))
    if transport == "reset":
        updated = updated._replace(moment_count=jnp.zeros_like(state.moment_count))
    return updated


def _all_reduce_mean(tree, axis_name):
    """Mean over the leading worker axis (and ``axis_name``); floats sent per worker."""
    mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)
    if axis_name is not None:
        mean = jax.lax.pmean(mean, axis_name)
    floats = sum(int(x.size) for x in jax.tree.leaves(mean))
    return mean, floats


class SyncResult(NamedTuple):
    """What :func:`lordo_sync` returns.

    Attributes:
        anchor: the new global parameters.
        worker_params: every worker reset to ``anchor`` (leading worker axis kept).
        worker_opt_states: optimiser states with the new ``Q`` and transported moments.
        outer_state: the outer optimiser's state.
        floats_sent: floats each worker put into the all-reduce (int32 scalar; exact).
    """

    anchor: Any
    worker_params: Any
    worker_opt_states: Any
    outer_state: Any
    floats_sent: jax.Array


def lordo_sync(
    worker_params,
    anchor_params,
    worker_opt_states,
    *,
    outer: optax.GradientTransformation | None = None,
    outer_state: optax.OptState | None = None,
    transport: Literal["rotate", "reset"] = "rotate",
    projection: Literal["global", "local"] = "global",
    axis_name: str | None = None,
) -> SyncResult:
    """LoRDO's every-``K``-steps synchronisation (pure; jit- and ``shard_map``-able).

    ``Δ_m = θ_m − θ_anchor``; ``Δ = mean_m Δ_m`` (the one all-reduce); the anchor takes the
    outer step on ``−Δ`` (default :func:`outer_average`: ``θ_anchor + Δ``, the workers' mean);
    per low-rank leaf ``Q_new`` = top-``r`` left singular vectors of ``Δ`` (``projection=
    "local"``: of each worker's own ``Δ_m``, the ablation); moments are rotated by ``R =
    Q_newᵀQ_old`` (or reset); every worker restarts from the anchor; ``E`` is kept.

    Args:
        worker_params: params with a leading worker axis ``[M_local, ...]``.
        anchor_params: the params at the last sync (no worker axis).
        worker_opt_states: the workers' optax states (leading worker axis); every
            :class:`ScaleByLordoState` inside (under ``chain``, ``partition``, ...) is updated.
        outer: outer optimiser on the pseudo-gradient ``−Δ`` (default :func:`outer_average`).
        outer_state: its state (``None``: initialised here).
        transport: ``"rotate"`` or ``"reset"`` (zero moments, restart bias correction).
        projection: ``"global"`` (LoRDO) or ``"local"``.
        axis_name: the mesh axis the workers are sharded over (under ``shard_map``), or
            ``None`` when all workers are on the leading axis of this process.

    Returns:
        A :class:`SyncResult`.
    """
    if transport not in ("rotate", "reset"):
        raise ValueError(f"lordo_sync: transport={transport!r} must be 'rotate' or 'reset'.")
    if projection not in ("global", "local"):
        raise ValueError(f"lordo_sync: projection={projection!r} must be 'global' or 'local'.")
    outer = outer_average() if outer is None else outer
    displacement = jax.tree.map(lambda w, a: w - a[None], worker_params, anchor_params)
    mean_delta, floats = _all_reduce_mean(displacement, axis_name)
    if outer_state is None:
        outer_state = outer.init(anchor_params)
    step, outer_state = outer.update(jax.tree.map(jnp.negative, mean_delta), outer_state,
                                     anchor_params)
    anchor = optax.apply_updates(anchor_params, step)
    workers = jax.tree.map(lambda w, a: jnp.broadcast_to(a[None], w.shape).astype(w.dtype),
                           worker_params, anchor)
    sources = _flat_by_path(mean_delta if projection == "global" else displacement)
    states = _map_lordo_states(
        lambda s: _reproject(s, sources, transport, stacked=True), worker_opt_states)
    return SyncResult(anchor, workers, states, outer_state, jnp.asarray(floats, jnp.int32))


def set_projection(opt_state, grads, *, axis_name: str | None = None, stacked: bool = False):
    """Step-0 global projection: ``Q_0`` from the SVD of the all-reduced gradient.

    Args:
        opt_state: an optax state holding :class:`ScaleByLordoState` (stacked over workers when
            ``stacked``).
        grads: the (clipped) gradients, with a leading worker axis when ``stacked``.
        axis_name: mesh axis to all-reduce over, as in :func:`lordo_sync`.
        stacked: whether ``grads`` / ``opt_state`` carry a leading worker axis.

    Returns:
        ``(opt_state, floats_sent)``: only low-rank leaves are communicated.
    """
    if not stacked:
        grads = jax.tree.map(lambda g: g[None], grads)
    found = {}

    def collect(state):
        for path, q in jax.tree_util.tree_flatten_with_path(state.projection)[0]:
            if q.ndim == (3 if stacked else 2):
                found[normalize_path(path)] = True
        return state

    _map_lordo_states(collect, opt_state)
    flat = _flat_by_path(grads)
    low = {p: flat[p] for p in found}
    mean, floats = _all_reduce_mean(low, axis_name)

    def apply(state):
        new = _reproject(state, mean, "reset", stacked=stacked)
        return new._replace(moment_count=state.moment_count)

    return _map_lordo_states(apply, opt_state), jnp.asarray(floats, jnp.int32)


def communication_per_sync(params) -> int:
    """Floats each worker sends per sync: ``|θ|`` (one all-reduce of the displacements)."""
    return sum(int(jnp.size(x)) for x in jax.tree.leaves(params))


__all__ = [
    "SyncResult",
    "communication_per_sync",
    "lordo_sync",
    "outer_average",
    "outer_nesterov",
    "set_projection",
]
