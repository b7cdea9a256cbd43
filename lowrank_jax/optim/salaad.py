"""SALAAD: sparse + low-rank structure grown during training by an augmented Lagrangian.

Each selected weight ``X`` is tied to a surrogate ``L + S`` (``L`` low-rank, ``S`` sparse) by the
penalty ``(ρ/2)‖X − L − S + Y/ρ‖²`` added to the task loss; every ``every`` optimiser steps an
ADMM block refreshes, in this order,

.. math::
    L = \\mathrm{SVT}_{\\alpha/\\rho}(X - S + Y/\\rho),\\quad
    \\alpha \\leftarrow \\alpha
    + \\rho\\,[k^I_\\alpha(c - c^*) + k^D_\\alpha \\max(0, c - c_{prev})],

    S = \\mathrm{soft}_{\\beta/\\rho}(X - L + Y/\\rho),\\quad
    \\beta \\leftarrow \\beta + \\rho\\,[k^I_\\beta(d - d^*) + k^D_\\beta \\max(0, d - d_{prev})],
    \\quad Y \\leftarrow Y + \\rho(X - L - S),

where ``c`` is the rank rate (squared-energy rank of ``L`` over ``min(m, n)``) and ``d`` the
density of ``S``; the derivative terms start after ``pd_start`` updates. Deployment
(:mod:`lowrank_jax.optim.salaad_deploy`) then cuts ``L`` and ``S`` to any parameter budget.

Two ways to use it: the pure functions :func:`salaad_init`, :func:`salaad_penalty`,
:func:`salaad_admm_step` beside any optax optimiser and any loop; or the transform
:func:`scale_by_salaad` (adds the penalty gradient and runs the ADMM block itself; its state holds
the :class:`SalaadState`), with :func:`salaad` = it chained with clipping and AdamW.

References:
    Ma et al., `SALAAD: Sparse And Low-Rank Adaptation via ADMM for Large Language Model
    Inference <https://arxiv.org/abs/2602.00942>`_, ICML 2026.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.optim.factors import normalize_path
from lowrank_jax.optim.linalg import Numeric
from lowrank_jax.core.rank import energy_rank
from lowrank_jax.core.sharding import place_like, replicate_like

Select = Callable[[tuple, Any], bool]


@dataclasses.dataclass(frozen=True)
class SalaadConfig:
    """Targets, controller gains and penalty of SALAAD (defaults: the reference configs).

    Attributes:
        rate_rank: target rank rate ``c*`` (energy rank of ``L`` over ``min(m, n)``).
        rate_sparsity: target density ``d*`` of ``S``.
        rho: penalty / dual step ``ρ`` (tiny in the reference: a gentle pull).
        energy: squared-singular-value energy that defines the training rank count.
        kI_alpha, kD_alpha, kI_beta, kD_beta: integral / derivative gains (on the thresholds).
        pd_start: ADMM updates before the derivative terms switch on.
        every: optimiser steps between ADMM blocks (for :func:`scale_by_salaad`).
    """

    rate_rank: float = 0.15
    rate_sparsity: float = 0.05
    rho: float = 1e-6
    energy: float = 0.999
    kI_alpha: float = 0.2
    kD_alpha: float = 0.01
    kI_beta: float = 0.002
    kD_beta: float = 0.01
    pd_start: int = 1500
    every: int = 2

    def __post_init__(self):
        for name in ("rate_rank", "rate_sparsity"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"SalaadConfig.{name}={value} must lie in [0, 1].")
        if not self.rho > 0:
            raise ValueError(f"SalaadConfig.rho={self.rho} must be > 0 (e.g. 1e-6).")
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"SalaadConfig.energy={self.energy} must lie in (0, 1].")
        for name in ("kI_alpha", "kD_alpha", "kI_beta", "kD_beta"):
            if getattr(self, name) < 0:
                raise ValueError(f"SalaadConfig.{name}={getattr(self, name)} must be >= 0.")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"SalaadConfig.every={self.every!r} must be an int >= 1.")


class SalaadState(NamedTuple):
    """Per selected leaf (trees mirror the params; unselected leaves hold ``[1]`` zero
    placeholders).

    Attributes:
        low_rank: ``L`` (fp32, the leaf's shape).
        sparse: ``S`` (fp32).
        dual: ``Y`` (fp32).
        alpha: nuclear-norm weight ``α`` (threshold ``α/ρ``); shape=().
        beta: ℓ1 weight ``β`` (threshold ``β/ρ``); shape=().
        rho: penalty ``ρ``; shape=().
        rank_rate: the last rank rate ``c``; shape=().
        density: the last density ``d``; shape=().
        updates: ADMM blocks run so far; shape=(), int32.
    """

    low_rank: Any
    sparse: Any
    dual: Any
    alpha: Any
    beta: Any
    rho: Any
    rank_rate: Any
    density: Any
    updates: jax.Array


def default_select(path: tuple, leaf) -> bool:
    """Every 2-D leaf with both sides >= 2 (projections and embeddings of a Llama)."""
    del path
    return jnp.ndim(leaf) == 2 and min(jnp.shape(leaf)) >= 2


def svt(matrix: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
    """Singular-value thresholding ``U max(σ − t, 0) Vᵀ`` (prox of ``t‖·‖_*``); also ``σ'``."""
    u, sigma, vt = jnp.linalg.svd(matrix.astype(jnp.float32), full_matrices=False)
    shrunk = jnp.maximum(sigma - threshold, 0.0)
    return (u * shrunk) @ vt, shrunk


def soft_threshold(matrix: jax.Array, threshold) -> jax.Array:
    """Elementwise ``sign(z) max(|z| − t, 0)`` (prox of ``t‖·‖_1``)."""
    return jnp.sign(matrix) * jnp.maximum(jnp.abs(matrix) - threshold, 0.0)


def _selected_paths(params, select: Select) -> set:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {normalize_path(p) for p, x in flat if select(normalize_path(p), x)}


def _map_with_path(fn, tree, *rest):
    return jax.tree_util.tree_map_with_path(lambda p, *xs: fn(normalize_path(p), *xs),
                                            tree, *rest)


def salaad_init(params, config: SalaadConfig = SalaadConfig(),
                select: Select | None = None) -> SalaadState:
    """``L = S = Y = 0`` and ``α = β = 0`` on every leaf ``select(path, leaf)`` picks.

    Args:
        params: the parameter tree.
        config: a :class:`SalaadConfig`.
        select: ``(path tuple, leaf) -> bool``; ``None``: :func:`default_select`.

    Returns:
        A :class:`SalaadState`.
    """
    select = default_select if select is None else select
    chosen = _selected_paths(params, select)
    if not chosen:
        raise ValueError(
            "salaad_init: select picked no leaf; SALAAD needs at least one 2-D weight "
            "(check the select function against the param paths)."
        )

    def big(path, x):
        if path in chosen:
            return jnp.zeros_like(x, dtype=jnp.float32)
        return replicate_like(jnp.zeros((1,), jnp.float32), x)  # orbax: no 0-size

    def scalar(value):
        return lambda path, x: replicate_like(
            jnp.asarray(value if path in chosen else 0.0, jnp.float32), x)

    zeros = lambda: _map_with_path(big, params)
    return SalaadState(
        zeros(), zeros(), zeros(), _map_with_path(scalar(0.0), params),
        _map_with_path(scalar(0.0), params), _map_with_path(scalar(config.rho), params),
        _map_with_path(scalar(1.0), params), _map_with_path(scalar(0.0), params),
        jnp.zeros([], jnp.int32) if not jax.tree.leaves(params)
        else replicate_like(jnp.zeros([], jnp.int32), jax.tree.leaves(params)[0]))


def _residual(x, l, s, y, rho):
    return x.astype(jnp.float32) - l - s + y / rho


def salaad_penalty(params, state: SalaadState) -> jax.Array:
    """``Σ ρ/2 ‖X − L − S + Y/ρ‖²`` over selected leaves (``L, S, Y`` get no gradient)."""
    stop = jax.lax.stop_gradient

    def one(x, l, s, y, rho):
        if jnp.ndim(l) != 2:
            return jnp.zeros([], jnp.float32)
        r = _residual(x, stop(l), stop(s), stop(y), stop(rho))
        return 0.5 * stop(rho) * jnp.sum(r * r)

    terms = jax.tree.map(one, params, state.low_rank, state.sparse, state.dual, state.rho)
    return sum(jax.tree.leaves(terms), jnp.zeros([], jnp.float32))


def penalty_gradient(params, state: SalaadState):
    """``ρ(X − L − S + Y/ρ)`` per selected leaf, zeros elsewhere (the gradient of the penalty)."""

    def one(x, l, s, y, rho):
        if jnp.ndim(l) != 2:
            return jnp.zeros_like(x)
        return (rho * _residual(x, l, s, y, rho)).astype(jnp.asarray(x).dtype)

    return jax.tree.map(one, params, state.low_rank, state.sparse, state.dual, state.rho)


def _controller(weight, rate, previous, target, k_i, k_d, rho, pd_on):
    step = k_i * (rate - target) + jnp.where(pd_on, k_d * jnp.maximum(0.0, rate - previous), 0.0)
    # DERIVED anti-windup: the reference lets α, β go negative; a negative threshold acts as 0,
    # so clamping the weight itself at 0 keeps the integral from winding up below it.
    return jnp.maximum(weight + rho * step, 0.0)


def salaad_admm_step(params, state: SalaadState,
                     config: SalaadConfig = SalaadConfig()) -> SalaadState:
    """One ADMM block (order L → α → S → β → Y, as the reference); jit-able.

    Args:
        params: the current weights ``X`` (only selected leaves are read).
        state: the :class:`SalaadState`.
        config: targets and gains.

    Returns:
        The new :class:`SalaadState` (``ρ`` is kept fixed).
    """
    pd_on = state.updates >= config.pd_start

    def one(x, l, s, y, alpha, beta, rho, c_prev, d_prev):
        if jnp.ndim(l) != 2:
            return l, s, y, alpha, beta, c_prev, d_prev
        x = x.astype(jnp.float32)
        l_new, sigma = svt(replicate_like(x - s + y / rho, x), jnp.maximum(alpha / rho, 0.0))
        l_new = place_like(l_new, l)
        c = energy_rank(sigma, config.energy) / min(l.shape)
        alpha = _controller(alpha, c, c_prev, config.rate_rank, config.kI_alpha,
                            config.kD_alpha, rho, pd_on)
        s_new = soft_threshold(x - l_new + y / rho, jnp.maximum(beta / rho, 0.0))
        d = jnp.mean((s_new != 0).astype(jnp.float32))
        beta = _controller(beta, d, d_prev, config.rate_sparsity, config.kI_beta,
                           config.kD_beta, rho, pd_on)
        y_new = y + rho * (x - l_new - s_new)
        return l_new, s_new, y_new, alpha, beta, c.astype(jnp.float32), d

    results = jax.tree.map(one, params, state.low_rank, state.sparse, state.dual, state.alpha,
                           state.beta, state.rho, state.rank_rate, state.density)
    fields = jax.tree.transpose(jax.tree.structure(params), jax.tree.structure((0,) * 7),
                                results)
    l, s, y, alpha, beta, c, d = fields
    return SalaadState(l, s, y, alpha, beta, state.rho, c, d,
                       optax.safe_increment(state.updates))


def _by_path(tree) -> dict:
    return {normalize_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def salaad_stats(params, state: SalaadState) -> dict[str, dict[str, float]]:
    """Per selected leaf (``'a/b/c'`` path): rank rate, density, thresholds, ``‖X−L−S‖/‖X‖``."""
    xs = _by_path(params)
    fields = {name: _by_path(getattr(state, name))
              for name in ("low_rank", "sparse", "rank_rate", "density", "alpha", "beta", "rho")}
    stats = {}
    for path, low in fields["low_rank"].items():
        if jnp.ndim(low) != 2:
            continue
        get = lambda name, path=path: fields[name][path]
        x = jnp.asarray(xs[path], jnp.float32)
        rel = jnp.linalg.norm(x - low - get("sparse")) / jnp.maximum(jnp.linalg.norm(x), 1e-12)
        stats["/".join(map(str, path))] = {
            "rank_rate": float(get("rank_rate")), "density": float(get("density")),
            "rank_threshold": float(jnp.maximum(get("alpha") / get("rho"), 0.0)),
            "sparse_threshold": float(jnp.maximum(get("beta") / get("rho"), 0.0)),
            "relative_residual": float(rel)}
    return stats


# ----------------------------------------------------------------------------- optax form


class ScaleBySalaadState(NamedTuple):
    """State of :func:`scale_by_salaad`: a step count and the :class:`SalaadState`."""

    count: jax.Array
    salaad: SalaadState


def scale_by_salaad(config: SalaadConfig = SalaadConfig(), *,
                    select: Select | None = None) -> optax.GradientTransformation:
    """Add SALAAD's penalty gradient and run its ADMM block every ``config.every`` steps.

    ``update(g, state, params)`` first runs :func:`salaad_admm_step` on ``params`` when
    ``count`` is a positive multiple of ``every`` (so the block sees the weights after the
    previous optimiser step), then returns ``g + ρ(X − L − S + Y/ρ)`` on selected leaves and
    ``g`` on the others ("coupled" variant: the penalty goes through the optimiser). Chain it
    *before* the optimiser (see :func:`salaad`). Needs ``params``.

    Args:
        config: a :class:`SalaadConfig`.
        select: which leaves get ``L + S`` (``None``: :func:`default_select`, every 2-D leaf;
            under ``optax.inject_hyperparams`` a callable needs ``static_args=('select',)``).

    Returns:
        A :class:`optax.GradientTransformation`; its state is :class:`ScaleBySalaadState`.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones((6, 4)), "b": jnp.zeros((4,))}
        >>> tx = optax.chain(scale_by_salaad(), optax.adam(1e-3))
        >>> updates, state = tx.update(params, tx.init(params), params)
        >>> state[0].salaad.low_rank["w"].shape, state[0].salaad.low_rank["b"].shape
        ((6, 4), (1,))
    """

    def init_fn(params):
        sstate = salaad_init(params, config, select)
        return ScaleBySalaadState(jnp.zeros_like(sstate.updates), sstate)

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_salaad: update needs params (the penalty reads X).")
        run = (state.count > 0) & (state.count % config.every == 0)
        sstate = jax.lax.cond(run, lambda: salaad_admm_step(params, state.salaad, config),
                              lambda: state.salaad)
        pull = penalty_gradient(params, sstate)
        out = jax.tree.map(lambda g, p: g + p.astype(g.dtype), updates, pull)
        return out, ScaleBySalaadState(optax.safe_increment(state.count), sstate)

    return optax.GradientTransformation(init_fn, update_fn)


def salaad(
    learning_rate: Numeric | optax.Schedule,
    config: SalaadConfig = SalaadConfig(),
    *,
    b1: Numeric = 0.9,
    b2: Numeric = 0.95,
    eps: Numeric = 1e-8,
    weight_decay: Numeric = 0.0,
    clip_norm: Numeric | None = 1.0,
    select: Select | None = None,
) -> optax.GradientTransformation:
    """The reference recipe: :func:`scale_by_salaad`, global-norm clip, AdamW (betas 0.9/0.95).

    Example::

        >>> import jax.numpy as jnp
        >>> params = {"w": jnp.ones((6, 4))}
        >>> tx = salaad(1e-3)
        >>> updates, _ = tx.update(params, tx.init(params), params)
        >>> updates["w"].shape
        (6, 4)
    """
    parts = [scale_by_salaad(config, select=select)]
    if clip_norm is not None and (isinstance(clip_norm, jax.Array) or clip_norm > 0):
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


def find_salaad_state(opt_state) -> SalaadState:
    """The :class:`SalaadState` inside an optax state built with :func:`scale_by_salaad`."""
    is_state = lambda x: isinstance(x, ScaleBySalaadState)
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)]
    if not found:
        raise ValueError("find_salaad_state: the optimiser state holds no scale_by_salaad state.")
    return found[0].salaad


__all__ = [
    "SalaadConfig",
    "SalaadState",
    "ScaleBySalaadState",
    "default_select",
    "find_salaad_state",
    "penalty_gradient",
    "salaad",
    "salaad_admm_step",
    "salaad_init",
    "salaad_penalty",
    "salaad_stats",
    "scale_by_salaad",
    "soft_threshold",
    "svt",
]
