"""Find the factor pairs of a parameter tree: one discovery, one ``pair_fn`` contract.

Every transform that acts on pairs (Spectron, BaLoRA, Janus, CrispEdit's LoRA path, LoDA) and
:func:`lowrank_jax.nn.apply_lora`'s bookkeeping use :func:`find_pairs`. A pair is two leaves under
the same parent, recognised by **NNX variable type** first and by name second (pure-array trees,
as ``nnx.Optimizer`` and ``optax.partition`` pass them, carry no types):

* kind ``"factor"`` — natively low-rank weights ``W = a·b``: :class:`lowrank_jax.nn.LowRankFactor`
  variables with ``role`` metadata ``"a"`` / ``"b"``, or leaves named ``a`` / ``b``;
* kind ``"lora"`` — adapters ``ΔW = s·lora_a·lora_b``: ``nnx.LoRAParam`` variables or leaves named
  ``lora_a`` / ``lora_b`` (also the stacked ``[K, in, R]`` / ``[K, R, out]`` factors of
  :class:`lowrank_jax.nn.MultiLoRALinear`).

Pairs are never guessed from shapes. ``optax.MaskedNode`` leaves are skipped.

**The contract.** A ``pair_fn`` is ``params -> list[(a_path, b_path)]``: paths are tuples of
names (dict keys, attribute names, list indices), without NNX's trailing ``value``; ``a`` is the
``[in, rank]`` side. ``find_pairs(params, kinds=("factor",))`` is Spectron's default,
``find_pairs(params, kinds=("lora",))`` BaLoRA's and Janus's; ``find_pairs(..., labels=...)``
labels the leaves for ``optax.partition``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import optax
from flax import nnx

Path = tuple[Any, ...]
PairKind = Literal["factor", "lora"]
PairFn = Callable[[Any], list[tuple[Path, Path]]]

#: role names per kind: (name of the ``[in, rank]`` side, name of the ``[rank, out]`` side)
ROLE_NAMES: dict[str, tuple[str, str]] = {"factor": ("a", "b"), "lora": ("lora_a", "lora_b")}


def _key_name(key) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def normalize_path(path) -> Path:
    """A key path as a plain tuple of names, without NNX's trailing ``.value`` accessor."""
    names = tuple(_key_name(k) for k in path)
    while (names and names[-1] in ("value", "raw_value")
           and isinstance(path[len(names) - 1], jax.tree_util.GetAttrKey)):
        names = names[:-1]
    return names


def path_str(path: Path) -> str:
    """``('layers', 0, 'mlp', 'up_proj', 'a')`` → ``'layers/0/mlp/up_proj/a'``."""
    return "/".join(str(p) for p in path)


def _is_leaf(x) -> bool:
    return isinstance(x, (nnx.Variable, optax.MaskedNode))


def _role_of(path: Path, leaf) -> tuple[str, str] | None:
    """``(kind, "a" | "b")`` of one leaf, or ``None`` when it is not a factor."""
    from lowrank_jax.nn.factorized import LowRankFactor

    last = path[-1] if path else None
    if isinstance(leaf, LowRankFactor):
        role = getattr(leaf, "role", None) or last
        if role not in ("a", "b"):
            raise ValueError(
                f"LowRankFactor at {path_str(path)!r} has role={role!r}; it must be 'a' or 'b'."
            )
        return "factor", role
    if isinstance(leaf, nnx.LoRAParam) and last not in ROLE_NAMES["lora"]:
        return None  # e.g. LoKRA's four factors: not an (A, B) pair
    for kind, (name_a, name_b) in ROLE_NAMES.items():
        if last == name_a:
            return kind, "a"
        if last == name_b:
            return kind, "b"
    return None


def factor_roles(params, *, kinds: Sequence[PairKind] = ("factor",)) -> dict[Path, str]:
    """Map every factor leaf's path to its role ``"a"`` or ``"b"`` (other leaves are absent).

    Args:
        params: a dict / ``nnx.State`` / masked pytree.
        kinds: which pair kinds to report (``"factor"``, ``"lora"``).

    Example::

        >>> import jax.numpy as jnp
        >>> factor_roles({"p": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}, "w": jnp.ones(3)})
        {('p', 'a'): 'a', ('p', 'b'): 'b'}
    """
    for kind in kinds:
        if kind not in ROLE_NAMES:
            raise ValueError(f"kinds={tuple(kinds)!r}: {kind!r} is unknown; use 'factor', 'lora'.")
    roles: dict[Path, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)[0]:
        if isinstance(leaf, optax.MaskedNode):
            continue
        p = normalize_path(path)
        found = _role_of(p, leaf)
        if found is not None and found[0] in kinds:
            roles[p] = found[1]
    return roles


def find_pairs(
    params,
    *,
    kinds: Sequence[PairKind] = ("factor", "lora"),
    labels: tuple[str, str] | None = None,
    pair_fn: PairFn | None = None,
):
    """The ``(a_path, b_path)`` pairs of a parameter tree, in tree order (the one discovery).

    Args:
        params: a dict / ``nnx.State`` (``Variable`` leaves or pure arrays) / masked pytree.
        kinds: the pair kinds to find (see the module docstring).
        labels: ``(pair_label, other_label)``: return instead a tree of strings with the
            structure of ``params`` (``Variable`` leaves become strings), ``pair_label`` on the
            leaves of a complete pair and ``other_label`` on the rest (embeddings, norms, biases,
            a dense LM head): the labels of ``optax.partition``.
        pair_fn: a custom ``pair_fn`` to use instead of the discovery by type and name
            (``kinds`` is then not read); useful with ``labels``.

    Returns:
        A list of ``(a_path, b_path)`` (each path a tuple of names), or the label tree when
        ``labels`` is given.

    Raises:
        ValueError: a parent holds an ``a`` without a ``b`` (or vice versa), naming the path.

    Example::

        >>> import jax.numpy as jnp
        >>> tree = {"proj": {"a": jnp.ones((8, 2)), "b": jnp.ones((2, 4))},
        ...         "q": {"kernel": jnp.ones((4, 4)), "lora_a": jnp.ones((4, 1)),
        ...               "lora_b": jnp.zeros((1, 4))}}
        >>> find_pairs(tree)
        [(('proj', 'a'), ('proj', 'b')), (('q', 'lora_a'), ('q', 'lora_b'))]
        >>> find_pairs(tree, kinds=("lora",))
        [(('q', 'lora_a'), ('q', 'lora_b'))]
        >>> find_pairs({"p": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}, "w": jnp.ones(3)},
        ...            kinds=("factor",), labels=("spectron", "adamw"))
        {'p': {'a': 'spectron', 'b': 'spectron'}, 'w': 'adamw'}
    """
    pairs = pair_fn(params) if pair_fn is not None else _discover(params, kinds)
    if labels is None:
        return pairs
    pair_label, other_label = labels
    in_pair = {p for pair in pairs for p in pair}

    def label(path, leaf):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        return pair_label if normalize_path(path) in in_pair else other_label

    return jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_leaf)


def _discover(params, kinds: Sequence[PairKind]) -> list[tuple[Path, Path]]:
    by_parent: dict[tuple[Path, str], dict[str, Path]] = {}
    for p, role in factor_roles(params, kinds=kinds).items():
        kind = "lora" if p[-1] in ROLE_NAMES["lora"] else "factor"
        slot = by_parent.setdefault((p[:-1], kind), {})
        if role in slot:
            raise ValueError(
                f"two factors with role {role!r} under {path_str(p[:-1]) or '<root>'!r}: "
                f"{path_str(slot[role])!r} and {path_str(p)!r}; each parent needs one 'a' and "
                "one 'b'."
            )
        slot[role] = p
    pairs = []
    for (parent, kind), slot in by_parent.items():
        if set(slot) != {"a", "b"}:
            (have,) = slot
            missing = ROLE_NAMES[kind][0 if have == "b" else 1]
            raise ValueError(
                f"half factor pair at {path_str(slot[have])!r}: no {missing!r} partner under "
                f"{path_str(parent) or '<root>'!r}. Add its partner, do not mask one factor of a "
                "pair out, or pass a custom pair_fn."
            )
        pairs.append((slot["a"], slot["b"]))
    return pairs


def check_learning_rate(owner: str, value, name: str = "learning_rate") -> None:
    """Refuse a learning rate that is not a finite number > 0 (a schedule, or a value traced by
    ``optax.inject_hyperparams``, is taken as given).

    Raises:
        TypeError: ``value`` is neither a number nor a callable schedule.
        ValueError: a NaN / inf / non-positive number, naming ``owner`` and ``name``.
    """
    if callable(value) or isinstance(value, jax.core.Tracer):
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name}={value!r} must be a number or an optax schedule, "
                        "e.g. 0.02 or optax.cosine_decay_schedule(0.02, 1000).") from None
    if not (number > 0 and number != float("inf")):
        raise ValueError(f"{owner}: {name}={value!r} must be a finite number > 0 (or an optax "
                         "schedule), e.g. 0.02.")


def has_unmasked_leaves(tree) -> bool:
    """Whether ``tree`` holds any leaf other than ``optax.MaskedNode``."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    return any(not isinstance(x, optax.MaskedNode) for x in leaves)


def flatten_by_path(tree) -> tuple[dict[Path, Any], list[Path], Any]:
    """``({path: leaf}, paths in leaf order, treedef)`` of a pytree (the pair_fn path keys).

    ``MaskedNode`` is an empty pytree and NNX Variables flatten to their value, so the leaves are
    exactly the arrays and :func:`unflatten_by_path` restores masks and Variable wrappers.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    order = [normalize_path(p) for p, _ in leaves]
    return {normalize_path(p): leaf for p, leaf in leaves}, order, treedef


def unflatten_by_path(treedef, order: list[Path], values: dict[Path, Any]):
    """Inverse of :func:`flatten_by_path`."""
    return jax.tree_util.tree_unflatten(treedef, [values[p] for p in order])


__all__ = ["PairFn", "ROLE_NAMES", "factor_roles", "find_pairs", "flatten_by_path",
           "normalize_path", "path_str", "unflatten_by_path"]
