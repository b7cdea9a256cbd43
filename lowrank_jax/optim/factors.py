"""Find the (A, B) factor pairs of a parameter tree, explicitly and inspectably.

A factor pair is two leaves named ``a`` (``[in, rank]``) and ``b`` (``[rank, out]``) under the
same parent, or two :class:`lowrank_jax.nn.LowRankFactor` variables with ``role`` metadata
``"a"`` / ``"b"`` under the same parent (what :class:`lowrank_jax.nn.FactorizedLinear` creates).
Pairs are never guessed from shapes. Works on plain dicts, ``nnx.State`` (with ``Variable``
leaves or pure arrays, as ``nnx.Optimizer`` passes them) and trees masked by
``optax.partition`` / ``optax.masked`` (``optax.MaskedNode`` leaves are skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

Path = tuple[Any, ...]


def _key_name(key) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def normalize_path(path) -> Path:
    """A key path as a plain tuple of names, without NNX's trailing ``.value`` accessor."""
    names = tuple(_key_name(k) for k in path)
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]
    return names


def path_str(path: Path) -> str:
    """``('layers', 0, 'mlp', 'up_proj', 'a')`` → ``'layers/0/mlp/up_proj/a'``."""
    return "/".join(str(p) for p in path)


def _is_leaf(x) -> bool:
    return isinstance(x, (nnx.Variable, optax.MaskedNode))


def factor_roles(params) -> dict[Path, str]:
    """Map every factor leaf's path to its role ``"a"`` or ``"b"`` (other leaves are absent).

    A leaf is a factor when it is a ``LowRankFactor`` variable (role from its metadata) or when
    its last path entry is the name ``a`` or ``b``.
    """
    from lowrank_jax.nn.factorized import LowRankFactor

    roles: dict[Path, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_leaf)[0]:
        if isinstance(leaf, optax.MaskedNode):
            continue
        p = normalize_path(path)
        if isinstance(leaf, LowRankFactor):
            role = getattr(leaf, "role", None) or (p[-1] if p else None)
            if role not in ("a", "b"):
                raise ValueError(
                    f"LowRankFactor at {path_str(p)!r} has role={role!r}; it must be 'a' or 'b'."
                )
            roles[p] = role
        elif p and p[-1] in ("a", "b"):
            roles[p] = p[-1]
    return roles


def factor_pairs(params) -> list[tuple[Path, Path]]:
    """The ``(path_to_a, path_to_b)`` pairs of a parameter tree, in tree order.

    Args:
        params: a dict / ``nnx.State`` / masked pytree of parameters.

    Returns:
        A list of ``(a_path, b_path)``; each path is a tuple of names (``'a'``/``'b'`` last).

    Raises:
        ValueError: a parent holds an ``a`` without a ``b`` (or vice versa), naming the path.

    Example::

        >>> import jax.numpy as jnp
        >>> params = {"proj": {"a": jnp.ones((8, 2)), "b": jnp.ones((2, 4))}, "bias": jnp.ones(4)}
        >>> factor_pairs(params)
        [(('proj', 'a'), ('proj', 'b'))]
    """
    by_parent: dict[Path, dict[str, Path]] = {}
    for p, role in factor_roles(params).items():
        slot = by_parent.setdefault(p[:-1], {})
        if role in slot:
            raise ValueError(
                f"two factors with role {role!r} under {path_str(p[:-1]) or '<root>'!r}: "
                f"{path_str(slot[role])!r} and {path_str(p)!r}; each parent needs one 'a' and "
                "one 'b'."
            )
        slot[role] = p
    pairs = []
    for parent, slot in by_parent.items():
        if set(slot) != {"a", "b"}:
            (have,) = slot
            missing = "b" if have == "a" else "a"
            raise ValueError(
                f"half factor pair at {path_str(slot[have])!r}: no {missing!r} under "
                f"{path_str(parent) or '<root>'!r}. Rename the leaf, add its partner, or route "
                "it away from the factor optimizer with a custom label function."
            )
        pairs.append((slot["a"], slot["b"]))
    return pairs


def label_factors(
    params,
    factor_label: str = "spectron",
    other_label: str = "adamw",
    *,
    pair_fn=None,
):
    """Label every leaf for ``optax.partition``: factors get ``factor_label``, the rest
    ``other_label`` (embeddings, norms, biases, a dense LM head).

    Args:
        params: the parameter tree (dict or ``nnx.State``).
        factor_label: label of leaves that belong to a complete factor pair.
        other_label: label of every other leaf.
        pair_fn: custom ``params -> [(a_path, b_path)]`` (default :func:`factor_pairs`).

    Returns:
        A tree of strings with the structure of ``params`` (``Variable`` leaves become strings).

    Example::

        >>> import jax.numpy as jnp
        >>> label_factors({"p": {"a": jnp.ones((4, 2)), "b": jnp.ones((2, 3))}, "w": jnp.ones(3)})
        {'p': {'a': 'spectron', 'b': 'spectron'}, 'w': 'adamw'}
    """
    in_pair = {p for pair in (pair_fn or factor_pairs)(params) for p in pair}

    def label(path, leaf):
        if isinstance(leaf, optax.MaskedNode):
            return leaf
        return factor_label if normalize_path(path) in in_pair else other_label

    return jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_leaf)


PairFn = Callable[[Any], list[tuple[Path, Path]]]
default_pair_fn: PairFn = factor_pairs

__all__ = ["default_pair_fn", "factor_pairs", "factor_roles", "label_factors", "normalize_path",
           "path_str"]
