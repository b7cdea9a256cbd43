"""CSPLoRA rank planning: a confidence-weighted probe scores modules, a budget sets their ranks.

Stage 1 (probe): run a few batches through the frozen base model, weight each sample by how
unsure the model is, and accumulate the first-order Taylor saliency ``Σ|W ⊙ ∇_W L_w|`` of every
target module. Stage 2 (calibrate + smooth): divide by the mean score of the module type and
take ``log(1 + ·)``. Stage 3 (allocate): ``r_min`` everywhere, the rest of a parameter budget
shared in proportion to the smoothed scores. The result ``{path: rank}`` feeds
``apply_lora(model, rules, ranks=plan)``.

References:
    Ding et al, *Confidence-guided Structural Planning for LoRA* (CSPLoRA), ICML 2026,
    https://openreview.net/forum?id=WkARznT46l
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Literal, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from lowrank_jax.core.losses import token_logprob
from lowrank_jax.nn.inject import module_path

Strategy = Literal["fixed", "adaptive", "uniform"]


def sample_weights(
    difficulty: Float[Array, " batch"],
    *,
    strategy: Strategy = "fixed",
    gamma: float = 2.0,
    gamma_scale: float = 1.0,
    gamma_max: float = 10.0,
    min_std: float = 1e-4,
) -> Float[Array, " batch"]:
    """Confidence weights ``w = softmax(γ d)`` over a batch (constants: no gradient).

    .. math::

        d_i = 1 - p_\\theta(y_i | x_i),\\qquad
        w_i = \\frac{e^{\\gamma d_i}}{\\sum_j e^{\\gamma d_j}}

    ``"adaptive"`` uses ``γ_eff = min(γ_s / std(d), γ_max)`` on centred difficulties (uniform
    when ``std(d) < min_std``); ``"uniform"`` (or ``γ = 0``, or a batch of one) gives ``1/B``.

    Example::

        >>> import jax.numpy as jnp
        >>> sample_weights(jnp.array([0.0, 0.0])).tolist()
        [0.5, 0.5]
    """
    d = jax.lax.stop_gradient(jnp.asarray(difficulty, jnp.float32))
    n = d.shape[0]
    if strategy not in ("fixed", "adaptive", "uniform"):
        raise ValueError(f"sample_weights: strategy={strategy!r}; use fixed, adaptive or uniform.")
    if strategy == "uniform" or n == 1:
        return jnp.full((n,), 1.0 / n)
    if strategy == "fixed":
        return jax.nn.softmax(gamma * d)
    std = jnp.std(d)
    gamma_eff = jnp.minimum(gamma_scale / jnp.maximum(std, min_std), gamma_max)
    weights = jax.nn.softmax(gamma_eff * (d - d.mean()))
    return jnp.where(std < min_std, jnp.full((n,), 1.0 / n), weights)


def per_sample_loss_and_confidence(
    logits: Float[Array, "batch time vocab"], targets: Int[Array, "batch time"]
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """Token-mean cross-entropy ``ℓ_i`` and confidence ``c_i`` = mean gold-token probability.

    Targets ``< 0`` (e.g. -100) are ignored.

    Example::

        >>> import jax.numpy as jnp
        >>> logits, labels = jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), int)
        >>> loss, conf = per_sample_loss_and_confidence(logits, labels)
        >>> round(float(conf[0]), 2)
        0.25
    """
    valid = targets >= 0
    gold = token_logprob(logits, jnp.maximum(targets, 0))
    count = jnp.maximum(valid.sum(axis=1), 1)
    loss = -jnp.where(valid, gold, 0.0).sum(axis=1) / count
    conf = jnp.where(valid, jnp.exp(gold), 0.0).sum(axis=1) / count
    return loss, conf


def target_linear_shapes(model: nnx.Module, targets: str) -> dict[str, tuple[int, int]]:
    """``{path: (in, out)}`` of every ``nnx.Linear`` whose path matches the regex ``targets``.

    Example::

        >>> from flax import nnx
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.up = nnx.Linear(3, 5, rngs=nnx.Rngs(0))
        >>> target_linear_shapes(M(), "up")
        {'up': (3, 5)}
    """
    shapes = {module_path(p): (m.in_features, m.out_features)
              for p, m in nnx.iter_modules(model)
              if isinstance(m, nnx.Linear) and re.search(targets, module_path(p))}
    if not shapes:
        available = [module_path(p) for p, m in nnx.iter_modules(model)
                     if isinstance(m, nnx.Linear)]
        raise ValueError(f"targets={targets!r} matches no nnx.Linear; available: "
                         f"{', '.join(available[:12])}")
    return shapes


def probe_importance(
    model: nnx.Module,
    batches: Iterable[tuple[Int[Array, "batch time"], Int[Array, "batch time"]]],
    *,
    targets: str,
    strategy: Strategy = "fixed",
    gamma: float = 2.0,
    metric: Literal["taylor", "fisher", "mean_taylor"] = "taylor",
) -> dict[str, float]:
    """Per-module saliency of the frozen base model under confidence-weighted gradients.

    .. math:: S_\\ell = \\frac1T \\sum_t \\big\\| W_\\ell \\odot \\nabla_{W_\\ell}
              \\textstyle\\sum_i w_i \\ell_i \\big\\|_1

    (``"fisher"``: ``Σ G²``; ``"mean_taylor"``: mean ``|W·G|``.) Gradients are taken only with
    respect to the target kernels; the model is not changed. DERIVED: a fixed number of probe
    batches (whatever ``batches`` yields) instead of the code's early-stopping rule.

    Args:
        model: a model returning ``(logits, ...)`` or logits for ``tokens [b, t]``.
        batches: ``(inputs, targets)`` token batches.
        targets: regex selecting the ``nnx.Linear`` modules to score.
        strategy, gamma: see :func:`sample_weights`.
        metric: the saliency.

    Returns:
        ``{path: score}`` (non-finite scores are dropped to 0).

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> m = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32),
        ...           rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 4), jnp.int32)
        >>> sorted(probe_importance(m, [(x, x)], targets="q_proj"))
        ['layers/0/self_attn/q_proj']
    """
    shapes = target_linear_shapes(model, targets)
    paths = set(shapes)

    def is_target(path, value):
        return (isinstance(value, nnx.Param) and path[-1] == "kernel"
                and module_path(path[:-1]) in paths)

    diff = nnx.DiffState(0, is_target)

    def weighted_loss(model, inputs, labels):
        out = model(inputs)
        logits = out[0] if isinstance(out, tuple) else out
        losses, conf = per_sample_loss_and_confidence(logits, labels)
        weights = sample_weights(1.0 - conf, strategy=strategy, gamma=gamma)
        return jnp.sum(weights * losses)

    @nnx.jit
    def saliency(model, inputs, labels):
        grads = nnx.grad(weighted_loss, argnums=diff)(model, inputs, labels)
        return {module_path(path[:-1]): (g[...] if isinstance(g, nnx.Variable) else g)
                for path, g in nnx.to_flat_state(grads)}

    kernels = {module_path(p): m.kernel for p, m in nnx.iter_modules(model)
               if module_path(p) in paths}
    totals = {p: 0.0 for p in paths}
    steps = 0
    for inputs, labels in batches:
        grads = saliency(model, jnp.asarray(inputs), jnp.asarray(labels))
        for name, g in grads.items():
            w = kernels[name][...].astype(jnp.float32)
            g = g.astype(jnp.float32)
            if metric == "taylor":
                score = jnp.sum(jnp.abs(w * g))
            elif metric == "fisher":
                score = jnp.sum(g * g)
            elif metric == "mean_taylor":
                score = jnp.mean(jnp.abs(w * g))
            else:
                raise ValueError(f"probe_importance: metric={metric!r}; use taylor, fisher or "
                                 "mean_taylor.")
            score = float(score)
            totals[name] += score if math.isfinite(score) else 0.0
        steps += 1
    if steps == 0:
        raise ValueError("probe_importance: batches is empty; pass at least one probe batch.")
    return {p: totals[p] / steps for p in sorted(paths)}


def default_module_type(path: str) -> str:
    """The module type used for calibration: the last path component (``q_proj``, ``up_proj``)."""
    return path.rsplit("/", 1)[-1]


def calibrate_and_smooth(
    scores: Mapping[str, float], *, tau: float = 1.0, module_type=default_module_type
) -> dict[str, float]:
    """``s̃ = log(1 + max(S / mean_type(S), 1e-12))^{1/τ}``: per-type calibration, log smoothing.

    Example::

        >>> calibrate_and_smooth({"a/q": 1.0, "b/q": 3.0})["b/q"] > 0.9
        True
    """
    by_type: dict[str, list[float]] = {}
    for path, s in scores.items():
        by_type.setdefault(module_type(path), []).append(float(s))
    means = {t: sum(v) / len(v) for t, v in by_type.items()}
    out = {}
    for path, s in scores.items():
        mean = means[module_type(path)]
        calibrated = float(s) / mean if mean > 0 else 1.0
        out[path] = math.log1p(max(calibrated, 1e-12)) ** (1.0 / tau)
    return out


def uniform_budget(shapes: Mapping[str, tuple[int, int]], rank: int) -> int:
    """Parameters of uniform rank-``rank`` LoRA on ``shapes``: ``Σ rank · (in + out)``.

    Example::

        >>> uniform_budget({"a": (4, 6), "b": (6, 4)}, 2)
        40
    """
    return int(sum(rank * (i + o) for i, o in shapes.values()))


def allocate_ranks(
    importance: Mapping[str, float],
    budget_params: int,
    shapes: Mapping[str, tuple[int, int]],
    *,
    r_min: int = 2,
    r_max: int = 32,
) -> dict[str, int]:
    """Integer ranks under a LoRA parameter budget, shares proportional to importance.

    A rank-``r`` adapter on an ``in × out`` layer costs ``r (in + out)`` parameters. Every module
    gets ``r_min``; the remaining budget ``E`` is shared as rank increments proportional to the
    (smoothed) importance:

    .. math:: r_\\ell = r_{\\min} + \\Big\\lfloor t\\, \\tilde s_\\ell \\Big\\rfloor,\\qquad
              t = \\frac{E}{\\sum_k \\tilde s_k (in_k + out_k)}

    capped at ``min(r_max, in, out)``; leftover parameters then go one rank at a time to modules
    in descending importance (cycling) while they fit. DERIVED: the paper budgets total *rank*
    (``R_tot = L · r_base``); we budget *parameters*, which keeps increment ratios equal to the
    importance ratios (scale invariance) and makes "as many parameters as uniform rank-8 LoRA"
    exact (:func:`uniform_budget`).

    Args:
        importance: ``{path: s̃ >= 0}`` (e.g. :func:`calibrate_and_smooth` of a probe).
        budget_params: total adapter parameters allowed.
        shapes: ``{path: (in, out)}`` for every path in ``importance``.
        r_min, r_max: rank bounds.

    Returns:
        ``{path: rank}`` whose cost ``Σ r (in + out)`` is at most ``budget_params``.

    Raises:
        ValueError: when even ``r_min`` everywhere exceeds the budget (the message names the
            budget and that minimum), or when a path has no shape.

    Example::

        >>> allocate_ranks({"a": 1.0, "b": 3.0}, 96, {"a": (8, 8), "b": (8, 8)}, r_min=1)
        {'a': 2, 'b': 4}
    """
    if not importance:
        raise ValueError("allocate_ranks: importance is empty; probe at least one module.")
    missing = sorted(set(importance) - set(shapes))
    if missing:
        raise ValueError(f"allocate_ranks: shapes lacks {missing[:4]}; pass (in, out) for every "
                         "scored module (see target_linear_shapes).")
    if r_min < 1 or r_max < r_min:
        raise ValueError(f"allocate_ranks: need 1 <= r_min <= r_max, got r_min={r_min}, "
                         f"r_max={r_max}.")
    paths = sorted(importance, key=lambda p: (-float(importance[p]), p))
    cost = {p: shapes[p][0] + shapes[p][1] for p in paths}
    cap = {p: min(r_max, shapes[p][0], shapes[p][1]) for p in paths}
    too_small = [p for p in paths if cap[p] < r_min]
    if too_small:
        raise ValueError(f"allocate_ranks: r_min={r_min} exceeds min(in, out) of {too_small[:3]}.")
    minimum = sum(r_min * cost[p] for p in paths)
    if budget_params < minimum:
        raise ValueError(
            f"allocate_ranks: budget_params={budget_params} is below the minimum {minimum} "
            f"needed for r_min={r_min} on {len(paths)} modules; raise the budget, lower r_min, "
            "or adapt fewer modules."
        )
    scores = {p: max(float(importance[p]), 0.0) for p in paths}
    weighted = sum(scores[p] * cost[p] for p in paths)
    extra = budget_params - minimum
    ranks = {p: r_min for p in paths}
    if weighted > 0:
        t = extra / weighted
        for p in paths:
            ranks[p] = min(cap[p], r_min + int(math.floor(t * scores[p])))
    spent = sum(ranks[p] * cost[p] for p in paths)
    progress = True
    while progress:
        progress = False
        for p in paths:
            if ranks[p] < cap[p] and spent + cost[p] <= budget_params:
                ranks[p] += 1
                spent += cost[p]
                progress = True
    return {p: ranks[p] for p in sorted(ranks)}


def plan_ranks(
    model: nnx.Module,
    batches,
    *,
    targets: str,
    budget_params: int | None = None,
    average_rank: int = 8,
    r_min: int = 2,
    r_max: int = 32,
    gamma: float = 2.0,
    strategy: Strategy = "fixed",
) -> tuple[dict[str, int], dict[str, float]]:
    """Probe, calibrate, allocate: the CSPLoRA plan ``{path: rank}`` and the raw scores.

    The budget defaults to the parameters of uniform ``average_rank`` LoRA on the targets.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> m = Llama(LlamaConfig(d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32),
        ...           rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 4), jnp.int32)
        >>> plan, _ = plan_ranks(m, [(x, x)], targets="v_proj", average_rank=4, r_min=1)
        >>> sum(plan.values())
        8
    """
    shapes = target_linear_shapes(model, targets)
    scores = probe_importance(model, batches, targets=targets, gamma=gamma, strategy=strategy)
    smoothed = calibrate_and_smooth(scores)
    budget = uniform_budget(shapes, average_rank) if budget_params is None else budget_params
    return allocate_ranks(smoothed, budget, shapes, r_min=r_min, r_max=r_max), scores


__all__ = ["allocate_ranks", "calibrate_and_smooth", "default_module_type",
           "per_sample_loss_and_confidence", "plan_ranks", "probe_importance", "sample_weights",
           "target_linear_shapes", "uniform_budget"]
