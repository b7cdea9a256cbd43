"""Spectron: spectral renormalization with orthogonalization for native low-rank pretraining.

For every factor pair ``W = a·b`` (``a`` ``[m, r]``, ``b`` ``[r, n]``) Spectron orthogonalizes
each factor's momentum with Newton–Schulz and scales both by one shared step

.. math:: \\rho = \\frac{\\eta_t}{\\sigma_a + \\sigma_b + 1},

with ``σ`` from warm-started power iteration, so that
``‖ΔW‖₂ ≤ ρ‖b‖₂ + ρ‖a‖₂ + ρ² ≤ η_t`` whenever ``‖O‖₂ ≤ 1`` and ``ρ ≤ 1``.

Spectron is a *complete* optimizer for factor pairs (its output already is ``−ρ·O``); never chain
it after ``scale_by_adam``. Route the other parameters to AdamW with :func:`spectron_with_adamw`.

References:
    Janson, Oyallon, Belilovsky, `Stabilizing Native Low-Rank LLM Pretraining
    <https://arxiv.org/abs/2602.12429>`_, ICML 2026.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lowrank_jax.optim.factors import (
    Path,
    PairFn,
    check_learning_rate,
    find_pairs,
    flatten_by_path,
    normalize_path,
    path_str,
    unflatten_by_path,
)
from lowrank_jax.optim.linalg import Numeric
from lowrank_jax.optim.linalg import (
    MUON_COEFFS,
    newton_schulz,
    power_iteration,
    spectral_norm_exact,
)

ScalarOrSchedule = optax.ScalarOrSchedule  # float, array (inject_hyperparams) or schedule


class SpectronState(NamedTuple):
    """State of :func:`scale_by_spectron`.

    Attributes:
        count: steps taken (skipped non-finite steps not counted); shape=(), dtype=int32.
        mu: fp32 EMA momentum, same tree as the params (``a``: ``[m, r]``, ``b``: ``[r, n]``).
        v: fp32 power-iteration vectors, same tree as the params, each of shape ``[r]``
            (the rank-sized side of its factor).
    """

    count: jax.Array
    mu: optax.Updates
    v: optax.Updates


def _is_leaf(x) -> bool:
    return isinstance(x, (nnx.Variable, optax.MaskedNode))


def _value(x):
    return x[...] if isinstance(x, nnx.Variable) else x


def _concrete(x) -> float | None:
    """``float(x)`` when ``x`` is a concrete number, ``None`` when it is traced."""
    if isinstance(x, jax.core.Tracer):
        return None
    return float(x)


def _explicit(x) -> bool:
    """Whether ``x`` lives on a mesh with an ``Explicit`` axis (sharding-aware code path)."""
    mesh = getattr(getattr(jax.typeof(_value(x)), "sharding", None), "mesh", None)
    return mesh is not None and any(
        t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _rank_of(shape, role: str) -> int:
    return shape[1] if role == "a" else shape[0]


def _check_layout(
    params, pair_fn: PairFn | None
) -> tuple[list[tuple[Path, Path]], dict[Path, str]]:
    pairs = find_pairs(params, kinds=("factor",), pair_fn=pair_fn)
    roles = {p: "a" for p, _ in pairs} | {p: "b" for _, p in pairs}
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)[0]
    shapes = {}
    for path, leaf in leaves:
        if isinstance(leaf, optax.MaskedNode):
            continue
        p = normalize_path(path)
        if p not in roles:
            raise ValueError(
                f"spectron: leaf {path_str(p)!r} is not part of an (a, b) factor pair. Spectron "
                "only updates factors; route other leaves to AdamW with spectron_with_adamw or "
                "find_pairs(params, labels=('spectron', 'adamw'))."
            )
        shapes[p] = jnp.shape(_value(leaf))
        dtype = jnp.result_type(_value(leaf))
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"spectron: factor {path_str(p)!r} has dtype {dtype}; factors must be "
                            "floating point (cast with .astype(jnp.float32)).")
        if len(shapes[p]) != 2:
            raise ValueError(f"spectron: factor {path_str(p)!r} must be 2-D, got {shapes[p]}.")
    for pa, pb in pairs:
        (_, r), (r2, _) = shapes[pa], shapes[pb]
        if r != r2:
            raise ValueError(
                f"spectron: factor pair {path_str(pa)!r} {shapes[pa]} and {path_str(pb)!r} "
                f"{shapes[pb]} disagree on the rank; a must be [in, r] and b [r, out]."
            )
    return pairs, roles


def _on_mesh_of(x, ref):
    """Replicate ``x`` on ``ref``'s Explicit mesh (so init and update agree on ``jax.typeof``)."""
    sharding = getattr(jax.typeof(ref), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not any(
        t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())
    ):
        return x
    spec = PartitionSpec(*([None] * x.ndim))
    concrete = getattr(ref, "sharding", None)
    if isinstance(concrete, NamedSharding) and not isinstance(ref, jax.core.Tracer):
        return jax.device_put(x, NamedSharding(concrete.mesh, spec))
    if jax.sharding.get_abstract_mesh().empty:  # traced without jax.set_mesh: leave it to jit
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


_flat, _unflat = flatten_by_path, unflatten_by_path


def scale_by_spectron(
    *,
    momentum: Numeric = 0.95,
    nesterov: bool = False,
    ns_steps: int = 5,
    ns_coeffs=MUON_COEFFS,
    power_iters: int = 1,
    weight_decay: Numeric = 0.0,
    wd_scale: Literal["eta", "rho"] = "eta",
    exact_norm: bool = False,
    eps: Numeric = 1e-7,
    pair_fn: PairFn | None = None,
    mu_dtype: Any = jnp.float32,
    batch_pairs: bool = True,
) -> optax.GradientTransformation:
    """The Spectron direction per factor pair, before the (negative) step ``η_t``.

    Per pair, with EMA momentum ``M ← βM + (1−β)G`` (fp32) and ``O = NS(M)``:

    .. math::
        d_a = \\frac{O_a}{\\sigma_a + \\sigma_b + 1} + \\lambda' a, \\qquad
        d_b = \\frac{O_b}{\\sigma_a + \\sigma_b + 1} + \\lambda' b

    where ``λ' = λ`` (``wd_scale="eta"``, so the final decay is ``η_t λ``, as NVIDIA's
    implementation) or ``λ' = λ/(σ_a+σ_b+1)`` (``wd_scale="rho"``, decay ``ρλ``). Multiplying by
    ``−η_t`` (:func:`spectron`) gives the paper's update ``−ρ·O``. ``σ`` are computed from the
    factors *before* the update, by one warm-started power iteration (state ``v``), or exactly
    from the ``r×r`` Gram matrix with ``exact_norm=True``.

    Non-finite gradients: if any gradient entry is NaN/Inf the step is skipped — the output is
    all zeros and the state (count, momentum, power vectors) is returned unchanged (DERIVED,
    design rule "non-finite updates are detected, not applied").

    Args:
        momentum: EMA coefficient ``β``.
        nesterov: orthogonalize ``βM + (1−β)G`` instead of ``M``.
        ns_steps: Newton–Schulz iterations.
        ns_coeffs: ``(a, b, c)``, a sequence of triples, or ``"exact"`` (SVD polar factor).
        power_iters: power iterations per step.
        weight_decay: decoupled decay ``λ`` (default 0).
        wd_scale: ``"eta"`` or ``"rho"`` (see above).
        exact_norm: use exact spectral norms (``eigvalsh`` of the Gram) instead of power
            iteration.
        eps: added to the Frobenius norm before Newton–Schulz.
        pair_fn: ``params -> [(a_path, b_path)]`` (see :mod:`lowrank_jax.optim.factors`;
            default ``find_pairs(params, kinds=("factor",))``); every unmasked leaf must be in a
            pair.
        mu_dtype: dtype of the momentum ``mu`` (default float32, whatever the params' dtype;
            ``None`` keeps each param's dtype). The arithmetic is always fp32.
        batch_pairs: run pairs of equal shapes as one batched (``vmap``) computation
            (default); ``False`` loops over pairs one by one (same math; the benchmark's
            "before" row).

    Returns:
        A :class:`optax.GradientTransformation` whose ``update`` needs ``params``.

    Example::

        >>> import jax.numpy as jnp, optax
        >>> params = {"p": {"a": jnp.ones((8, 2)), "b": jnp.ones((2, 4))}}
        >>> tx = optax.chain(scale_by_spectron(), optax.scale(-0.02))
        >>> state = tx.init(params)
        >>> updates, state = tx.update(params, state, params)
        >>> updates["p"]["a"].shape
        (8, 2)
    """
    # Under optax.inject_hyperparams numeric arguments arrive as arrays (traced in update):
    # check what is concrete; ns_steps and power_iters must be static_args there.
    if _concrete(momentum) is not None and not 0.0 <= _concrete(momentum) < 1.0:
        raise ValueError(f"spectron: momentum={momentum} must lie in [0, 1).")
    if wd_scale not in ("eta", "rho"):
        raise ValueError(f"spectron: wd_scale={wd_scale!r} must be 'eta' or 'rho'.")
    for name, value, low in (("power_iters", power_iters, 1), ("ns_steps", ns_steps, 0)):
        if isinstance(value, jax.Array) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"spectron: {name}={value!r} must be a Python int >= {low} (with "
                f"optax.inject_hyperparams pass static_args=('{name}', ...))."
            )
    if _concrete(weight_decay) is not None and _concrete(weight_decay) < 0:
        raise ValueError(f"spectron: weight_decay={weight_decay} must be >= 0.")
    no_decay = _concrete(weight_decay) == 0.0
    newton_schulz(jnp.ones((2, 2)), steps=0, coeffs=ns_coeffs)  # validates ns_coeffs early

    def init_fn(params):
        pairs, roles = _check_layout(params, pair_fn)
        del pairs
        values, order, treedef = _flat(params)
        mu, v = {}, {}
        for i, p in enumerate(order):
            leaf = values[p]
            mu[p] = jnp.zeros_like(leaf, dtype=mu_dtype or leaf.dtype)
            rank = _rank_of(leaf.shape, roles[p])
            vec = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (rank,))
            v[p] = _on_mesh_of(vec / jnp.linalg.norm(vec), leaf)
        count = jnp.zeros([], jnp.int32)
        if order:
            count = _on_mesh_of(count, values[order[0]])
        return SpectronState(
            count=count,
            mu=_unflat(treedef, order, mu),
            v=_unflat(treedef, order, v),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("spectron: update needs params (the factors set the step size).")
        pairs, _ = _check_layout(params, pair_fn)
        grads, order, treedef = _flat(updates)
        param_vals, _, _ = _flat(params)
        mu_old, mu_order, mu_def = _flat(state.mu)
        v_old, v_order, v_def = _flat(state.v)

        finite = jnp.array(True)
        for g in grads.values():
            finite = finite & jnp.all(jnp.isfinite(_value(g)))

        def pair_update(a, b, ga, gb, mua, mub, va, vb):
            """One pair's directions, new momenta and power vectors (fp32 arithmetic)."""
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            ortho, moments = [], []
            for g, mu in ((ga, mua), (gb, mub)):
                g = g.astype(jnp.float32)
                m = momentum * mu.astype(jnp.float32) + (1.0 - momentum) * g
                moments.append(m.astype(mu.dtype))
                ns_in = momentum * m + (1.0 - momentum) * g if nesterov else m
                ortho.append(newton_schulz(ns_in, steps=ns_steps, coeffs=ns_coeffs, eps=eps))
            if exact_norm:
                sigma_a, sigma_b = spectral_norm_exact(a), spectral_norm_exact(b)
            else:
                sigma_a, va = power_iteration(a, va, iters=power_iters)
                sigma_b, vb = power_iteration(b.T, vb, iters=power_iters)
            inv = 1.0 / (sigma_a + sigma_b + 1.0)
            decay = weight_decay * (inv if wd_scale == "rho" else 1.0)
            directions = []
            for o, w in zip(ortho, (a, b)):
                d = inv * o
                if not no_decay:
                    d = d + decay * w
                directions.append(d)
            return (*directions, *moments, va, vb)

        def inputs(pa, pb):
            return (_value(param_vals[pa]), _value(param_vals[pb]), _value(grads[pa]),
                    _value(grads[pb]), _value(mu_old[pa]), _value(mu_old[pb]),
                    _value(v_old[pa]), _value(v_old[pb]))

        # Pairs of equal shapes and dtypes run as one vmapped (batched) computation: one
        # Newton–Schulz and one power iteration per group instead of per pair. Explicit-sharded
        # factors keep the per-pair path (their sharding-aware contractions are 2-D).
        groups: dict[tuple, list[tuple[Path, Path]]] = {}
        for pa, pb in pairs:
            key = tuple((x.shape, x.dtype) for x in inputs(pa, pb))
            groups.setdefault(key if batch_pairs and not _explicit(param_vals[pa]) else
                              (pa, pb), []).append((pa, pb))
        out, mu_new, v_new = {}, {}, {}
        for members in groups.values():
            if len(members) == 1:
                results = [pair_update(*inputs(*members[0]))]
            else:
                stacked = [jnp.stack(xs) for xs in zip(*(inputs(*p) for p in members))]
                batched = jax.vmap(pair_update)(*stacked)
                results = [[x[i] for x in batched] for i in range(len(members))]
            for (pa, pb), (da, db, ma, mb, va, vb) in zip(members, results):
                out[pa], out[pb], mu_new[pa], mu_new[pb] = da, db, ma, mb
                v_new[pa], v_new[pb] = va, vb

        def select(new, old):
            return jnp.where(finite, new, old)

        dtype_of = {p: _value(grads[p]).dtype for p in order}
        out = {p: jnp.where(finite, out[p], 0.0).astype(dtype_of[p]) for p in order}
        mu_new = {p: select(mu_new[p], _value(mu_old[p])) for p in order}
        v_new = {p: select(v_new[p], _value(v_old[p])) for p in order}
        count = jnp.where(finite, optax.safe_increment(state.count), state.count)
        new_state = SpectronState(
            count=count,
            mu=_unflat(mu_def, mu_order, mu_new),
            v=_unflat(v_def, v_order, v_new),
        )
        return _unflat(treedef, order, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def spectron(
    learning_rate: ScalarOrSchedule,
    *,
    momentum: Numeric = 0.95,
    nesterov: bool = False,
    ns_steps: int = 5,
    ns_coeffs=MUON_COEFFS,
    power_iters: int = 1,
    weight_decay: Numeric = 0.0,
    wd_scale: Literal["eta", "rho"] = "eta",
    exact_norm: bool = False,
    eps: Numeric = 1e-7,
    pair_fn: PairFn | None = None,
    mu_dtype: Any = jnp.float32,
) -> optax.GradientTransformation:
    """Spectron for factor pairs: ``u_a = −ρ·NS(M_a)``, ``u_b = −ρ·NS(M_b)``,
    ``ρ = η_t/(σ_a+σ_b+1)``.

    .. math:: \\lVert (a+u_a)(b+u_b) - ab \\rVert_2 \\le \\rho(\\sigma_b + \\sigma_a + \\rho)
       \\le \\eta_t \\quad (\\lVert O\\rVert_2 \\le 1,\\ \\rho \\le 1)

    ``learning_rate`` (``η``) is a *spectral-norm budget for ΔW*, not a per-element step: AdamW
    or Muon learning rates do not transfer (a sweep of 0.005–0.1 is reasonable at small scale).
    The tree it sees must hold only factor pairs (``MaskedNode`` leaves allowed); for a whole
    model use :func:`spectron_with_adamw`. Non-finite gradients skip the step (zero update,
    unchanged state). Implemented as ``chain(scale_by_spectron(...),
    scale_by_learning_rate(learning_rate))``.

    Args:
        learning_rate: ``η`` as a float or an optax schedule (warmup/cosine act on ``η``).
        momentum, nesterov, ns_steps, ns_coeffs: see :func:`scale_by_spectron`, as are
            ``power_iters``, ``weight_decay``, ``wd_scale``, ``exact_norm``, ``eps``,
            ``pair_fn`` and ``mu_dtype``.

    Returns:
        A :class:`optax.GradientTransformation`.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> params = {"p": {"a": jnp.ones((8, 2)), "b": jnp.ones((2, 4))}}
        >>> tx = spectron(0.05)
        >>> state = tx.init(params)
        >>> grads = jax.tree.map(jnp.ones_like, params)
        >>> updates, state = jax.jit(tx.update)(grads, state, params)
        >>> params = optax.apply_updates(params, updates)

    References:
        Janson et al, `Stabilizing Native Low-Rank LLM Pretraining
        <https://arxiv.org/abs/2602.12429>`_, 2026.
    """
    check_learning_rate("spectron", learning_rate)
    return optax.chain(
        scale_by_spectron(
            momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_coeffs=ns_coeffs,
            power_iters=power_iters, weight_decay=weight_decay, wd_scale=wd_scale,
            exact_norm=exact_norm, eps=eps, pair_fn=pair_fn, mu_dtype=mu_dtype,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


def spectron_with_adamw(
    eta: ScalarOrSchedule,
    adamw_lr: ScalarOrSchedule,
    *,
    weight_decay: Numeric = 0.0,
    spectron_weight_decay: Numeric = 0.0,
    b1: Numeric = 0.9,
    b2: Numeric = 0.95,
    clip_norm: Numeric | None = None,
    momentum: Numeric = 0.95,
    nesterov: bool = False,
    ns_steps: int = 5,
    ns_coeffs=MUON_COEFFS,
    power_iters: int = 1,
    wd_scale: Literal["eta", "rho"] = "eta",
    exact_norm: bool = False,
    eps: Numeric = 1e-7,
    pair_fn: PairFn | None = None,
    mu_dtype: Any = None,
) -> optax.GradientTransformation:
    """A whole-model optimizer: Spectron on factor pairs, AdamW on every other leaf.

    ``optax.partition({"spectron": spectron(eta), "adamw": adamw(adamw_lr)}, labels)`` with the
    labels of ``find_pairs(params, kinds=("factor",), labels=("spectron", "adamw"))``,
    optionally preceded by ``clip_by_global_norm(clip_norm)``. Works with plain dicts and with
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)``. With ``optax.inject_hyperparams`` pass
    ``static_args=("ns_steps", "ns_coeffs", "power_iters", "pair_fn")`` so that ``eta`` and
    ``adamw_lr`` become per-step settable hyperparameters.

    Args:
        eta: Spectron's ``‖ΔW‖₂`` budget (float or schedule).
        adamw_lr: AdamW learning rate for embeddings, norms, biases, dense heads.
        weight_decay: AdamW's decoupled weight decay.
        spectron_weight_decay: Spectron's ``λ`` (see ``wd_scale``).
        b1, b2: AdamW betas (DERIVED: LLM-typical 0.9 / 0.95).
        clip_norm: optional global-norm clip applied to all gradients first.
        momentum, nesterov, ns_steps, ns_coeffs: forwarded to :func:`spectron`, as are
            ``power_iters``, ``wd_scale``, ``exact_norm``, ``eps`` and ``pair_fn``.
        mu_dtype: dtype of both first moments (``None``: Spectron's fp32 and AdamW's
            param dtype, the defaults of :func:`spectron` and ``optax.adamw``).

    Returns:
        A :class:`optax.GradientTransformation`.

    Example::

        >>> import jax.numpy as jnp
        >>> tx = spectron_with_adamw(0.02, 3e-3, weight_decay=0.1)
        >>> params = {"p": {"a": jnp.ones((8, 2)), "b": jnp.ones((2, 4))}, "norm": jnp.ones(4)}
        >>> state = tx.init(params)
    """
    check_learning_rate("spectron_with_adamw", eta, "eta")
    check_learning_rate("spectron_with_adamw", adamw_lr, "adamw_lr")
    tx = optax.partition(
        {
            "spectron": spectron(
                eta, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                ns_coeffs=ns_coeffs, power_iters=power_iters, weight_decay=spectron_weight_decay,
                wd_scale=wd_scale, exact_norm=exact_norm, eps=eps, pair_fn=pair_fn,
                mu_dtype=jnp.float32 if mu_dtype is None else mu_dtype,
            ),
            "adamw": optax.adamw(adamw_lr, b1=b1, b2=b2, weight_decay=weight_decay,
                                 mu_dtype=mu_dtype),
        },
        lambda params: find_pairs(params, kinds=("factor",), labels=("spectron", "adamw"),
                                  pair_fn=pair_fn),
    )
    if clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return tx


__all__ = ["SpectronState", "scale_by_spectron", "spectron", "spectron_with_adamw"]
