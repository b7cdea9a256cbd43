"""The lock-in probes as an optax transform: :func:`lockin_probe` and :func:`probe_metrics`.

The pure-function form of :class:`lowrank_jax.analysis.probes.LockinMonitor` (lockin_probes
spec §2, §3.1; all definitions DERIVED, the target paper was not found). ``lockin_probe`` is an
identity :class:`optax.GradientTransformation` placed **last** in a chain: it keeps the running
sum ``ΔW_t = Σ_{s≤t} δ_s`` of the updates it sees and, every ``every`` steps, records per probed
matrix the top-k subspace of ``ΔW_t``, its stable/effective rank, the subspace drift, the capture
ratio of the steps since the previous probe and, with reference curvature, the sharp fraction,
channelling index and harm signal. Everything runs inside ``jax.jit``; :func:`probe_metrics`
reads the last probe back on the host.

Layout: a Dense kernel is ``[d_in, d_out]``; curvature factors ``(A [d_in]², G [d_out]²)`` are
computed once at ``W_0`` on broad data (spec §7), in the format of
:func:`lowrank_jax.analysis.probes.harm_signal`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array

from lowrank_jax.analysis.probes import CurvatureBasis, curvature_basis, project_sharp
from lowrank_jax.core.rank import effective_rank, stable_rank

_TINY = 1e-30


class LockinLeafState(NamedTuple):
    """Per probed matrix: accumulators, the last probe's bases and metrics."""

    delta: Array  # [d_in, d_out]: ΔW_t, running sum of every update seen
    since_probe: Array  # [d_in, d_out]: sum of the updates since the last probe
    u: Array  # [d_in, k]: orthonormal top-k left basis of ΔW at the last probe
    v: Array  # [d_out, k]: orthonormal top-k right basis of ΔW at the last probe
    metrics: dict[str, Array]  # name -> shape=() metric of the last probe


class LockinProbeState(NamedTuple):
    """State of :func:`lockin_probe`."""

    count: Array  # shape=(), int32: updates seen so far (the current step t)
    last_probe: Array  # shape=(), int32: step of the last probe, −1 before the first
    probes: Array  # shape=(), int32: probes done (drift/capture are valid from the 2nd on)
    drift: Array  # shape=(): max drift over probed leaves at the last probe
    harm: Array  # shape=(): h = ½ Σ_l tr(A_l ΔW_l G_l ΔW_lᵀ) at the last probe (0 w/o curvature)
    calm: Array  # shape=(), int32: consecutive calm probes (drift < lock_tol, all ‖ΔW‖ grew)
    t_lock: Array  # shape=(), int32: lock-in step, −1 until lock-in
    leaves: dict[str, LockinLeafState]  # leaf path ("layer/kernel") -> its probe state


def _key_name(key) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def _path_string(path) -> str:
    """``(DictKey('layer'), DictKey('kernel'))`` → ``'layer/kernel'`` (NNX's ``.value`` dropped)."""
    names = [_key_name(k) for k in path]
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]
    return "/".join(str(n) for n in names)


def _is_leaf(x) -> bool:
    return isinstance(x, (nnx.Variable, optax.MaskedNode))


def _named_leaves(tree) -> list[tuple[str, Any]]:
    """``[(path string, array)]`` of a pytree; NNX variables unwrapped, masked leaves skipped."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]:
        if isinstance(leaf, optax.MaskedNode) or leaf is None:
            continue
        if isinstance(leaf, nnx.Variable):
            leaf = leaf.get_value()
        out.append((_path_string(path), leaf))
    return out


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int.")


def _drift(u_prev: Array, u_now: Array) -> Array:
    """``‖sin Θ(U_prev, U_now)‖_F / √k`` for orthonormal ``[d, k]`` bases.

    Uses ``‖(I − U_prev U_prevᵀ) U_now‖_F``, whose singular values are the sines of the principal
    angles; unlike ``arccos`` of the cosines it stays accurate near zero drift.
    """
    residual = u_now - u_prev @ (u_prev.T @ u_now)
    return jnp.linalg.norm(residual) / math.sqrt(u_now.shape[1])


def _metric_names(has_curvature: bool) -> tuple[str, ...]:
    names = ("stable_rank", "effective_rank", "norm", "drift", "capture")
    if has_curvature:
        names += ("phi", "phi_iso", "channelling", "phi_step", "harm")
    return names


def lockin_probe(
    *,
    k: int = 8,
    every: int = 10,
    lock_tol: float = 0.1,
    lock_patience: int = 3,
    curvatures: Mapping[str, Any] | None = None,
    energy: float = 0.9,
    where: Callable[[str, Any], bool] | None = None,
) -> optax.GradientTransformation:
    """Identity transform that probes the cumulative update subspace (lock-in, spec §3.1–3.3).

    Place it **last** in ``optax.chain(...)``: it accumulates ``ΔW_t = Σ_{s≤t} δ_s``, the sum of
    the updates it receives, which equals ``W_t − W_0`` only if nothing after it changes the
    update (``optax.apply_updates`` adds exactly these). Updates pass through unchanged.

    At every step ``t`` with ``t % every == 0`` (``t`` counts from 1), for each probed matrix:

    .. math::

        \\Delta W_t = U_t \\Sigma_t V_t^\\top \\ (\\text{top-}k),\\quad
        sr_t = \\frac{\\sum_{i\\le k}\\sigma_i^2}{\\sigma_1^2},\\quad
        er_t = \\exp(-\\textstyle\\sum_{i\\le k} p_i\\ln p_i),\\ p_i = \\sigma_i/\\sum\\sigma,

        D_t = \\max\\Big(\\frac{\\|\\sin\\Theta(U_t,U_{t'})\\|_F}{\\sqrt k},
                        \\frac{\\|\\sin\\Theta(V_t,V_{t'})\\|_F}{\\sqrt k}\\Big),\\quad
        \\kappa_t = \\frac{\\|U_{t'}U_{t'}^\\top S\\,V_{t'}V_{t'}^\\top\\|^2}{\\|S\\|^2},

    with ``t'`` the previous probe and ``S = ΔW_t − ΔW_{t'}`` the updates since then. Ranks use
    the top-k spectrum (as :class:`LockinMonitor`). ``T_lock`` is the first probe step at which
    ``max_l D_t < lock_tol`` has held for ``lock_patience`` consecutive probes, each with every
    probed ``‖ΔW‖_F`` larger than at the probe before. With ``curvatures[path] = (A, G)``:
    ``phi = ‖P_sharp ΔW‖²/‖ΔW‖²``, ``phi_iso = n_sharp/(d_in d_out)``, ``channelling =
    phi/phi_iso``, ``phi_step`` (the same on ``S``) and ``harm = ½ tr(A ΔW G ΔWᵀ)``.

    The SVD is exact (``jnp.linalg.svd``), fine for probe sizes and every 10–50 steps. Choose
    ``k`` at most the rank ``ΔW`` really has: trailing singular vectors of a null space are
    arbitrary and make the drift meaningless.

    Args:
      k: subspace dimension, clipped to ``min(d_in, d_out)`` per matrix.
      every: probe every ``every`` steps.
      lock_tol: drift below which a probe is calm.
      lock_patience: consecutive calm probes that declare lock-in.
      curvatures: optional ``{leaf path: (A, G)}`` (or objects with ``.A``/``.G``), computed at
        ``W_0`` on broad data; leaf paths are ``"/"``-joined keys, e.g. ``"dense/kernel"``.
      energy: energy ``γ`` of the sharp/soft split (:func:`~probes.curvature_basis`).
      where: optional predicate ``(path, leaf) -> bool`` choosing the probed leaves (all must be
        2-D); default: every 2-D leaf.

    Returns:
      A :class:`optax.GradientTransformation` object; read it with :func:`probe_metrics`.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> params = {"w": jnp.zeros((4, 3))}
        >>> tx = optax.chain(optax.sgd(1.0), lockin_probe(k=1, every=1, lock_patience=2))
        >>> state = tx.init(params)
        >>> grad = {"w": -jnp.outer(jnp.arange(4.0), jnp.ones(3))}
        >>> step = jax.jit(tx.update)
        >>> for _ in range(4):
        ...     updates, state = step(grad, state)
        ...     params = optax.apply_updates(params, updates)
        >>> m = probe_metrics(state)
        >>> m["t_lock"], round(m["per_layer"]["w"]["stable_rank"], 4)
        (3, 1.0)
    """
    _check_positive_int("k", k)
    _check_positive_int("every", every)
    _check_positive_int("lock_patience", lock_patience)
    if not float(lock_tol) > 0.0:
        raise ValueError(f"lock_tol={lock_tol!r} must be > 0.")
    if not 0.0 < float(energy) <= 1.0:
        raise ValueError(f"energy={energy!r} must lie in (0, 1].")
    curvatures = dict(curvatures or {})
    bases: dict[str, CurvatureBasis] = {
        name: curvature_basis(c, energy=energy) for name, c in curvatures.items()
    }
    # Sharp/soft split is fixed: its isotropic baseline is a constant per leaf.
    phi_iso = {name: float(jnp.sum(~b.soft)) / b.soft.size for name, b in bases.items()}

    def _selected(path: str, leaf) -> bool:
        if where is None:
            return getattr(leaf, "ndim", None) == 2
        if not where(path, leaf):
            return False
        if getattr(leaf, "ndim", None) != 2:
            raise ValueError(
                f"lockin_probe: `where` selected {path!r} with shape "
                f"{getattr(leaf, 'shape', None)}; only 2-D matrices can be probed. Make `where` "
                "return False for it."
            )
        return True

    def init_fn(params):
        leaves = {}
        for path, leaf in _named_leaves(params):
            if not _selected(path, leaf):
                continue
            d_in, d_out = leaf.shape
            kk = min(k, d_in, d_out)
            dtype = jnp.promote_types(leaf.dtype, jnp.float32)
            metrics = {n: jnp.zeros((), dtype) for n in _metric_names(path in bases)}
            if path in bases:
                b = bases[path]
                if b.u_a.shape[0] != d_in or b.u_g.shape[0] != d_out:
                    raise ValueError(
                        f"lockin_probe: leaf {path!r} {leaf.shape} needs A [{d_in}]² and "
                        f"G [{d_out}]², got A {b.u_a.shape}, G {b.u_g.shape}."
                    )
            leaves[path] = LockinLeafState(
                delta=jnp.zeros(leaf.shape, dtype),
                since_probe=jnp.zeros(leaf.shape, dtype),
                u=jnp.zeros((d_in, kk), dtype),
                v=jnp.zeros((d_out, kk), dtype),
                metrics=metrics,
            )
        unknown = sorted(set(bases) - set(leaves))
        if unknown:
            raise ValueError(
                f"lockin_probe: curvatures given for {unknown}, which are not probed leaves; "
                f"probed leaves are {sorted(leaves)}."
            )
        if not leaves:
            raise ValueError(
                "lockin_probe: no leaf to probe (no 2-D leaf, or `where` rejected all). Pass a "
                "params tree with matrices or a `where` that selects some."
            )
        scalar_dtype = jnp.result_type(*(leaf.delta.dtype for leaf in leaves.values()))
        return LockinProbeState(
            count=jnp.zeros((), jnp.int32),
            last_probe=jnp.full((), -1, jnp.int32),
            probes=jnp.zeros((), jnp.int32),
            drift=jnp.zeros((), scalar_dtype),
            harm=jnp.zeros((), scalar_dtype),
            calm=jnp.zeros((), jnp.int32),
            t_lock=jnp.full((), -1, jnp.int32),
            leaves=leaves,
        )

    def _probe_leaf(path: str, leaf: LockinLeafState, has_prev):
        delta, step = leaf.delta, leaf.since_probe
        kk = leaf.u.shape[1]
        u_full, s_full, vt_full = jnp.linalg.svd(delta, full_matrices=False)
        u, s, v = u_full[:, :kk], s_full[:kk], vt_full[:kk].T
        norm = jnp.linalg.norm(delta)
        nonzero = norm > 0
        zero = jnp.zeros((), delta.dtype)
        drift = jnp.maximum(_drift(leaf.u, u), _drift(leaf.v, v))
        step_sq = jnp.sum(jnp.square(step))
        capture = jnp.sum(jnp.square(leaf.u.T @ step @ leaf.v)) / jnp.maximum(step_sq, _TINY)
        metrics = {
            "stable_rank": jnp.where(nonzero, stable_rank(s), zero),
            "effective_rank": jnp.where(nonzero, effective_rank(s), zero),
            "norm": norm,
            "drift": jnp.where(has_prev, drift, zero),
            "capture": jnp.where(has_prev, capture, zero),
        }
        if path in bases:
            b = bases[path]
            a, g = _curvature_factors(curvatures[path])
            total = jnp.sum(jnp.square(delta))
            phi = jnp.sum(jnp.square(project_sharp(delta, b))) / jnp.maximum(total, _TINY)
            phi_step = jnp.sum(jnp.square(project_sharp(step, b))) / jnp.maximum(step_sq, _TINY)
            metrics.update(
                phi=phi,
                phi_iso=jnp.asarray(phi_iso[path], delta.dtype),
                channelling=phi / max(phi_iso[path], _TINY),
                phi_step=phi_step,
                harm=0.5 * jnp.sum((a @ delta @ g) * delta),
            )
        metrics = {n: jnp.asarray(x, delta.dtype) for n, x in metrics.items()}
        return leaf._replace(since_probe=jnp.zeros_like(step), u=u, v=v, metrics=metrics)

    def _probe(state: LockinProbeState) -> LockinProbeState:
        has_prev = state.probes > 0
        leaves = {p: _probe_leaf(p, leaf, has_prev) for p, leaf in state.leaves.items()}
        drift = jnp.max(jnp.stack([leaf.metrics["drift"] for leaf in leaves.values()]))
        grew = jnp.all(jnp.stack([
            new.metrics["norm"] > old.metrics["norm"]
            for new, old in zip(leaves.values(), state.leaves.values())
        ]))
        calm_now = (drift < lock_tol) & grew
        calm = jnp.where(has_prev, jnp.where(calm_now, state.calm + 1, 0), state.calm)
        locks = (state.t_lock < 0) & (calm >= lock_patience)
        harm = sum(
            (leaf.metrics["harm"] for leaf in leaves.values() if "harm" in leaf.metrics),
            jnp.zeros_like(state.harm),
        )
        return state._replace(
            last_probe=state.count,
            probes=optax.safe_int32_increment(state.probes),
            drift=drift.astype(state.drift.dtype),
            harm=harm.astype(state.harm.dtype),
            calm=calm.astype(jnp.int32),
            t_lock=jnp.where(locks, state.count, state.t_lock).astype(jnp.int32),
            leaves=leaves,
        )

    def update_fn(updates, state: LockinProbeState, params=None):
        del params
        named = dict(_named_leaves(updates))
        missing = sorted(set(state.leaves) - set(named))
        if missing:
            raise ValueError(
                f"lockin_probe: updates lack the probed leaves {missing}; pass update() a tree "
                "with the same leaves as the params given to init()."
            )
        leaves = {}
        for path, leaf in state.leaves.items():
            step = jnp.asarray(named[path], leaf.delta.dtype)
            leaves[path] = leaf._replace(delta=leaf.delta + step,
                                         since_probe=leaf.since_probe + step)
        new_state = state._replace(count=optax.safe_int32_increment(state.count), leaves=leaves)
        new_state = jax.lax.cond(new_state.count % every == 0, _probe, lambda s: s, new_state)
        return updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _curvature_factors(curvature):
    if hasattr(curvature, "A") and hasattr(curvature, "G"):
        return jnp.asarray(curvature.A), jnp.asarray(curvature.G)
    a, g = curvature
    return jnp.asarray(a), jnp.asarray(g)


def _find_states(tree) -> list[LockinProbeState]:
    is_state = lambda x: isinstance(x, LockinProbeState)  # noqa: E731
    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]
    if not found:  # nnx.Optimizer keeps opt_state as variables; look inside pure values.
        try:
            pure = nnx.as_pure(tree)
        except Exception:  # noqa: BLE001 - not an NNX tree
            pure = tree
        found = [x for x in jax.tree_util.tree_leaves(pure, is_leaf=is_state) if is_state(x)]
    return found


def probe_metrics(opt_state) -> dict:
    """Host-side readout of the last probe of a :func:`lockin_probe` state.

    Args:
      opt_state: the :class:`LockinProbeState` itself or any optimizer state that contains
        exactly one (e.g. the state of ``optax.chain(adam, lockin_probe(...))``).

    Returns:
      ``{"step", "per_layer", "drift", "harm", "t_lock", "calm"}`` as Python values (the keys of
      :meth:`LockinMonitor.update`): ``step`` of the last probe (None before the first),
      ``per_layer[path]`` a dict of floats (``drift``/``capture`` None at the first probe),
      ``drift`` the max over layers (None at the first probe), ``harm`` the total ``h`` (None
      without curvatures), ``t_lock`` (None before lock-in), ``calm`` the count of consecutive
      calm probes.

    Raises:
      ValueError: no, or more than one, lockin_probe state inside ``opt_state``.
    """
    found = _find_states(opt_state)
    if len(found) != 1:
        raise ValueError(
            f"probe_metrics found {len(found)} lockin_probe states in opt_state; pass a state "
            "holding exactly one (for several, pass each LockinProbeState separately)."
        )
    (state,) = found
    state = jax.device_get(state)
    last = int(state.last_probe)
    has_prev = int(state.probes) >= 2
    t_lock = int(state.t_lock)
    out: dict = {"step": None if last < 0 else last, "per_layer": {}, "drift": None,
                 "harm": None, "t_lock": None if t_lock < 0 else t_lock, "calm": int(state.calm)}
    if last < 0:
        return out
    with_harm = False
    for path, leaf in state.leaves.items():
        rec = {n: float(x) for n, x in leaf.metrics.items()}
        if not has_prev:
            rec["drift"] = rec["capture"] = None
        with_harm |= "harm" in rec
        out["per_layer"][path] = rec
    if has_prev:
        out["drift"] = float(state.drift)
    if with_harm:
        out["harm"] = float(state.harm)
    return out


__all__ = ["LockinLeafState", "LockinProbeState", "lockin_probe", "probe_metrics"]
