"""Add, merge and remove LoRA adapters on any Flax NNX model, selected by regex on module paths."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping

from flax import nnx

from lowrank_jax.nn.lora import LoRALinear


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


def module_path(path: tuple) -> str:
    """``('layers', 3, 'mlp', 'up_proj')`` → ``'layers/3/mlp/up_proj'``."""
    return "/".join(str(p) for p in path)


def linear_paths(model: nnx.Module) -> list[str]:
    """Paths of every plain ``nnx.Linear`` (not yet adapted) in ``model``."""
    return [
        module_path(p)
        for p, m in nnx.iter_modules(model)
        if type(m) is nnx.Linear
    ]


def _set_child(model: nnx.Module, path: tuple, new: Any) -> None:
    parent = model
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    last = path[-1]
    if isinstance(last, int):
        parent[last] = new
    else:
        setattr(parent, last, new)


def _as_rules(rules) -> list[LoRARule]:
    if isinstance(rules, LoRARule):
        return [rules]
    if isinstance(rules, str):
        return [LoRARule(rules)]
    if isinstance(rules, Mapping):
        return [LoRARule(k, rank=int(v)) for k, v in rules.items()]
    return [r if isinstance(r, LoRARule) else LoRARule(**r) for r in rules]


def apply_lora(
    model: nnx.Module,
    rules: LoRARule | str | Mapping[str, int] | Iterable[LoRARule | dict],
    *,
    rngs: nnx.Rngs,
    ranks: Mapping[str, int] | None = None,
) -> list[str]:
    """Replace every ``nnx.Linear`` whose path matches a rule by a :class:`LoRALinear` (in place).

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
    candidates = [(p, m) for p, m in nnx.iter_modules(model) if type(m) is nnx.Linear]
    available = [module_path(p) for p, _ in candidates]
    hits: dict[int, int] = {i: 0 for i in range(len(rules))}
    adapted = []
    for path, linear in candidates:
        name = module_path(path)
        for i, rule in enumerate(rules):
            if re.search(rule.pattern, name):
                hits[i] += 1
                rank = rule.rank if ranks is None or name not in ranks else int(ranks[name])
                new = LoRALinear.from_linear(
                    linear, rank=rank, alpha=rule.alpha, use_rslora=rule.use_rslora,
                    dropout=rule.dropout, init=rule.init, rngs=rngs,
                )
                _set_child(model, path, new)
                adapted.append(name)
                break
    for i, count in hits.items():
        if count == 0:
            shown = ", ".join(available[:12]) + (" ..." if len(available) > 12 else "")
            raise ValueError(
                f"apply_lora: rule pattern {rules[i].pattern!r} matches no nnx.Linear layer. "
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


def lora_layers(model: nnx.Module) -> list[tuple[str, LoRALinear]]:
    """``(path, layer)`` for every :class:`LoRALinear` in ``model``."""
    return [(module_path(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)]


def merge_lora(model: nnx.Module) -> int:
    """Fold every adapter into its kernel (in place); returns how many were merged."""
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
    """Replace each :class:`LoRALinear` by a plain ``nnx.Linear`` (merging first if ``merge``)."""
    count = 0
    for path, m in list(nnx.iter_modules(model)):
        if isinstance(m, LoRALinear):
            if merge and not m.merged:
                m.merge()
            lin = nnx.Linear(m.in_features, m.out_features, use_bias=m.bias is not None,
                             dtype=m.dtype, param_dtype=m.param_dtype, rngs=nnx.Rngs(0))
            lin.kernel = m.kernel
            lin.bias = m.bias
            _set_child(model, path, lin)
            count += 1
    return count
