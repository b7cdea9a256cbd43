"""The size of one optimizer step in weight space: ``max_l ‖W_l,new − W_l,old‖₂``.

Spectron's guarantee is ``‖ΔW‖₂ ≤ η`` for every factorized weight ``W = A B``; this measures it
(exactly, through the Gram eigenvalues) for a factorized model (its factor pairs, found by
:func:`lowrank_jax.optim.find_pairs`) and, for comparison, for a dense model (every ``kernel``
under ``layers``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from lowrank_jax.core.linalg import spectral_norm_exact
from lowrank_jax.optim.factors import find_pairs, normalize_path


def _measured(params) -> list:
    """The factor pairs of a factorized model, else ``(kernel_path, None)`` for every ``kernel``
    leaf under ``layers`` (a dense model)."""
    pairs = find_pairs(params, kinds=("factor",))
    if pairs:
        return pairs
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = normalize_path(path)
        if names and names[-1] == "kernel" and "layers" in names:
            out.append((names, None))
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def max_update_norm(params) -> Callable:
    """Jitted ``(old, new) -> max over the weights of ‖W_new − W_old‖₂`` (spectral norm,
    exact) for parameter trees shaped like ``params``: ``W = A B`` for each factor pair of a
    factorized model, else every ``kernel`` leaf under ``layers`` (a dense model).

    Example::

        >>> import jax.numpy as jnp
        >>> old = {"p": {"a": jnp.eye(3, 2), "b": jnp.eye(2, 3)}}
        >>> new = {"p": {"a": 2 * jnp.eye(3, 2), "b": jnp.eye(2, 3)}}
        >>> round(float(max_update_norm(old)(old, new)), 4)
        1.0
    """
    pairs = _measured(params)

    def fn(old, new):
        norms = []
        for pa, pb in pairs:
            if pb is None:
                delta = _get(new, pa) - _get(old, pa)
            else:
                delta = _get(new, pa) @ _get(new, pb) - _get(old, pa) @ _get(old, pb)
            norms.append(spectral_norm_exact(delta))
        return jnp.max(jnp.stack(norms))

    return jax.jit(fn)


__all__ = ["max_update_norm"]
