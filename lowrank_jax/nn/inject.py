"""Add, merge and remove LoRA adapters on any Flax NNX model, selected by regex on module paths."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Mapping

import numpy as np
from flax import nnx

from lowrank_jax.nn.lora import LoRALinear, LoRAProjection, QLoRALinear, lora_layers
from lowrank_jax.nn.merge import merge_adapters, unwrap
from lowrank_jax.nn.projection import (
    is_projection,
    module_path,
    outermost_projections,
    projection_type,
    set_child,
)


@dataclasses.dataclass(frozen=True)
class LoRARule:
    """Which layers get an adapter, and its hyperparameters.

    ``pattern`` is a regex searched (``re.search``) in the module path written with ``/``
    (for the Llama model: ``layers/3/self_attn/q_proj``).
    """

    pattern: str
    rank: int = 8
    alpha: float | None = None
    use_rslora: bool = False
    dropout: float = 0.0
    init: str = "standard"

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except (re.error, TypeError) as e:
            raise ValueError(
                f"LoRARule pattern {self.pattern!r} is not a valid regex ({e}); pass a regex "
                "searched in the module path, e.g. r'(q|v)_proj'."
            ) from None
        _check_positive_int(self.rank, "LoRARule rank")
        if self.alpha is not None and not (
            isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0
        ):
            raise ValueError(
                f"LoRARule alpha={self.alpha!r} must be a finite number > 0 "
                "(or None for alpha = rank)."
            )
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"LoRARule dropout={self.dropout!r} must lie in [0, 1).")


def _check_positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"{name}={value!r} must be a positive int (the adapter rank r); e.g. rank=8."
        )


def _as_rules(rules) -> list[LoRARule]:
    if isinstance(rules, LoRARule):
        return [rules]
    if isinstance(rules, str):
        return [LoRARule(rules)]
    if isinstance(rules, Mapping):
        return [LoRARule(k, rank=v) for k, v in rules.items()]
    return [r if isinstance(r, LoRARule) else LoRARule(**r) for r in rules]


def apply_lora(
    model: nnx.Module,
    rules: LoRARule | str | Mapping[str, int] | Iterable[LoRARule | dict],
    *,
    rngs: nnx.Rngs,
    ranks: Mapping[str, int] | None = None,
) -> list[str]:
    """Give every projection whose path matches a rule a LoRA adapter (in place).

    An ``nnx.Linear`` becomes a :class:`LoRALinear`, a quantized linear a
    :class:`~lowrank_jax.nn.QLoRALinear`, and every other projection (``nnx.LinearGeneral``,
    ``nnx.Einsum``, a user's einsum module: see :mod:`lowrank_jax.nn.projection`) a
    :class:`~lowrank_jax.nn.LoRAProjection` that keeps the module's call signature, with ``A``
    / ``B`` over the kernel's grouped ``[in, out]`` axes.
    The first matching rule wins. The base kernel is shared, and a fresh adapter has ``B = 0``
    (or the PiSSA residual split), so the model's output is unchanged at init.

    Example::

        >>> from flax import nnx
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(4, 8, rngs=rngs)
        ...         self.down = nnx.Linear(8, 4, rngs=rngs)
        >>> model = MLP(nnx.Rngs(0))
        >>> apply_lora(model, LoRARule("up", rank=2), rngs=nnx.Rngs(1))
        ['up']

    Args:
        model: any NNX module; modified in place.
        rules: a :class:`LoRARule`, a regex string (rank 8), a ``{regex: rank}`` mapping, or a
            sequence of rules / rule dicts.
        rngs: keys for the adapters' initialisation (and dropout).
        ranks: optional per-path ranks (e.g. from a CSPLoRA rank plan) overriding the rule's
            rank; a path given here that no rule matched is an error.

    Returns:
        The paths that were adapted, in model order.

    Raises:
        ValueError: when a rule matches no layer (the message lists the available paths).
    """
    rules = _as_rules(rules)
    _refuse_expert_kernels(model, rules)  # issue 49: expert kernels are refused, by name
    candidates = outermost_projections(model)  # an adapted layer's base is adapted already
    available = [module_path(p) for p, _ in candidates]
    hits: dict[int, int] = {i: 0 for i in range(len(rules))}
    adapted = []
    for path, linear in candidates:
        name = module_path(path)
        for i, rule in enumerate(rules):
            if re.search(rule.pattern, name):
                hits[i] += 1
                rank = rule.rank
                if ranks is not None and name in ranks:
                    rank = ranks[name]
                    _check_positive_int(rank, f"ranks[{name!r}]")
                    rank = int(rank)
                if type(linear) is nnx.Linear:
                    wrap = LoRALinear.from_linear
                elif projection_type(linear).frozen:
                    wrap = QLoRALinear
                else:
                    wrap = LoRAProjection
                new = wrap(
                    linear, rank=rank, alpha=rule.alpha, use_rslora=rule.use_rslora,
                    dropout=rule.dropout, init=rule.init, rngs=rngs,
                )
                set_child(model, path, new)
                adapted.append(name)
                break
    for i, count in hits.items():
        if count == 0:
            shown = ", ".join(available[:12]) + (" ..." if len(available) > 12 else "")
            raise ValueError(
                f"apply_lora: rule pattern {rules[i].pattern!r} matches no projection "
                "(nnx.Linear / LinearGeneral / Einsum / einsum module). "
                f"Available layer paths: {shown or '(none)'}"
            )
    if ranks is not None:
        unknown = sorted(set(ranks) - set(adapted))
        if unknown:
            raise ValueError(
                f"apply_lora: ranks given for paths no rule adapted: {unknown[:5]}. "
                f"Adapted paths: {adapted[:8]}"
            )
    return adapted


def merge_lora(model: nnx.Module) -> int:
    """Fold every adapter into its kernel in place (the layers stay adapted layers, see
    :func:`unmerge_lora`); returns how many were merged. A quantized base refuses: use
    :func:`lowrank_jax.nn.merge_adapters`."""
    layers = [m for _, m in lora_layers(model) if not m.merged]
    for m in layers:
        m.merge()
    return len(layers)


def unmerge_lora(model: nnx.Module) -> int:
    """Undo :func:`merge_lora` (in place); returns how many were unmerged."""
    layers = [m for _, m in lora_layers(model) if m.merged]
    for m in layers:
        m.unmerge()
    return len(layers)


def remove_lora(model: nnx.Module, *, merge: bool = True) -> int:
    """Put back the module each adapted layer replaced (in place): with ``merge`` the adapter is
    folded in (:func:`lowrank_jax.nn.merge_adapters`, into fp: a quantized base becomes a
    dense one), without it the adapter is dropped (a layer merged in place is unmerged first).
    Returns how many layers were replaced."""
    if merge:
        return len(merge_adapters(model, target="fp")) if lora_layers(model) else 0
    count = 0
    for path, m in list(nnx.iter_modules(model)):
        if isinstance(m, (LoRALinear, LoRAProjection)):
            if m.merged:
                m.unmerge()
            set_child(model, path, unwrap(m))
            count += 1
    return count


# ---------------------------------------------------------------- expert kernels (issue 49)
# The decision: a bare ``nnx.Param`` of 3+ axes (an MoE layer's expert kernels ``[E, in, out]``,
# which the layer indexes and einsums itself) gets no adapter, and a rule that matches one is
# an error naming it and the way out; it is never skipped silently.


def expert_kernels(model: nnx.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, shape)`` of every bare ``nnx.Param`` of 3 or more axes that is not a
    projection's kernel: the expert kernels ``[E, in, out]`` of an MoE layer.

    Example::

        >>> import jax.numpy as jnp
        >>> class MoE(nnx.Module):
        ...     def __init__(self):
        ...         self.router = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
        ...         self.up_proj = nnx.Param(jnp.zeros((4, 8, 16)))
        >>> expert_kernels(MoE())
        [('up_proj', (4, 8, 16))]
    """
    from lowrank_jax.nn.projection import NOT_PROJECTIONS, module_path

    found, skip = [], []
    for path, module in nnx.iter_modules(model):
        if any(path[:len(s)] == s for s in skip):
            continue
        # projections, adapters and factorized / quantized layers own their kernels
        if (is_projection(module) or isinstance(module, tuple(NOT_PROJECTIONS))
                or hasattr(module, "lora_a")):
            skip.append(path)
            continue
        for name, value in sorted(vars(module).items()):
            if (isinstance(value, nnx.Param) and not isinstance(value, nnx.LoRAParam)
                    and np.ndim(value[...]) >= 3):
                found.append((module_path(path + (name,)), tuple(np.shape(value[...]))))
    return found


def _refuse_expert_kernels(model: nnx.Module, rules: list[LoRARule]) -> None:
    experts = expert_kernels(model)
    for rule in rules:
        hit = [f"{p} {list(s)}" for p, s in experts if re.search(rule.pattern, p)]
        if hit:
            raise ValueError(
                f"apply_lora: rule pattern {rule.pattern!r} matches expert kernels: "
                f"{', '.join(hit[:4])}{' ...' if len(hit) > 4 else ''} (bare nnx.Param with an "
                "expert axis that the MoE layer indexes itself, not a projection module). "
                "LoRA per expert is not supported, and they are not skipped silently: narrow "
                "the rule to the projections (e.g. r'attn/' for the attention, or a pattern "
                "naming the router), or freeze the experts and train the rest.")
