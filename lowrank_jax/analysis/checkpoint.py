"""Layer-at-a-time reading of orbax checkpoints (host-side), so a large model never has to be in
memory at once.

Only the tree *metadata* (shapes, dtypes) is read up front; each selected leaf is then restored on
its own with orbax's partial restore (``PyTreeRestore(item=subtree, partial_restore=True)``),
converted to a float32 numpy array, used and dropped. Peak memory ≈ the largest leaf (×2 when two
checkpoints are compared in lock-step) plus the SVD workspace.

Leaf paths are ``"/"``-joined keys, e.g. ``"layers/3/self_attn/q_proj/kernel"`` (orbax stores
integer dict keys as strings).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator

import jax
import numpy as np


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _str_keys(tree):
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def save_params(path: str | os.PathLike, params) -> str:
    """Save a parameter tree (e.g. a Llama pure dict) as an orbax checkpoint at ``path``.

    Example::

        >>> import jax.numpy as jnp, tempfile, os
        >>> p = save_params(os.path.join(tempfile.mkdtemp(), "c"), {"w": jnp.ones((2, 2))})
        >>> os.path.isdir(p)
        True
    """
    path = os.path.abspath(os.fspath(path))
    ckpt = _ocp().StandardCheckpointer()
    ckpt.save(path, _str_keys(jax.tree.map(np.asarray, params)))
    ckpt.wait_until_finished()
    return path


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{leaf_path: (shape, dtype)}`` read from the checkpoint metadata (no arrays restored)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist (expected an orbax folder).")
    tree = _ocp().StandardCheckpointer().metadata(path).item_metadata.tree
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k in sorted(node, key=_sort_key):
                walk(node[k], prefix + (str(k),))
        else:
            out["/".join(prefix)] = (tuple(node.shape), str(node.dtype))

    walk(tree, ())
    return out


def _sort_key(k):
    s = str(k)
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def params_shapes(params) -> dict[str, tuple[tuple[int, ...], str]]:
    """Same as :func:`checkpoint_shapes` for an in-memory tree (keys stringified)."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
        out[name] = (tuple(np.shape(leaf)), str(np.asarray(leaf).dtype))
    return out


def restore_leaf(path: str | os.PathLike, leaf_path: str, *, shapes=None) -> np.ndarray:
    """Restore one leaf (partial restore) as a float32 numpy array.

    Example::

        >>> import jax.numpy as jnp, tempfile, os
        >>> p = save_params(os.path.join(tempfile.mkdtemp(), "c"), {"a": {"w": jnp.ones(3)}})
        >>> restore_leaf(p, "a/w").tolist()
        [1.0, 1.0, 1.0]
    """
    path = os.path.abspath(os.fspath(path))
    shapes = shapes or checkpoint_shapes(path)
    if leaf_path not in shapes:
        raise ValueError(f"leaf_path={leaf_path!r} is not in checkpoint {path!r}.")
    shape, dtype = shapes[leaf_path]
    item = jax.ShapeDtypeStruct(shape, np.dtype(dtype))
    for key in reversed(leaf_path.split("/")):
        item = {key: item}
    ocp = _ocp()
    restored = ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(item=item, partial_restore=True)
    )
    node = restored
    for key in leaf_path.split("/"):
        node = node[key]
    return np.asarray(node, dtype=np.float32)


def _selector(select) -> Callable[[str], bool]:
    if select is None:
        return lambda name: True
    if callable(select):
        return select
    pattern = re.compile(select)
    return lambda name: pattern.search(name) is not None


def iter_checkpoint_matrices(
    path: str | os.PathLike, select: str | Callable[[str], bool] | None = None, *,
    stack_axis: int | None = None,
) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """Yield ``(leaf_path, layer, matrix)`` for every selected 2-D (or stacked 3-D) leaf.

    Args:
      path: orbax checkpoint folder.
      select: regex searched in the leaf path, a predicate, or None for all.
      stack_axis: for scanned models whose kernels carry a leading layer axis, iterate along it
        (3-D leaves); ``layer`` is then the index along that axis, else None.

    Example::

        >>> import jax.numpy as jnp, tempfile, os
        >>> p = save_params(os.path.join(tempfile.mkdtemp(), "c"), {"w": jnp.ones((2, 3))})
        >>> [(name, m.shape) for name, _, m in iter_checkpoint_matrices(p)]
        [('w', (2, 3))]
    """
    shapes = checkpoint_shapes(path)
    keep = _selector(select)
    names = [n for n, (shape, _) in shapes.items() if keep(n)]
    for name in names:
        ndim = len(shapes[name][0])
        if stack_axis is None and ndim == 2:
            yield name, None, restore_leaf(path, name, shapes=shapes)
        elif stack_axis is not None and ndim == 3:
            leaf = restore_leaf(path, name, shapes=shapes)
            for i in range(leaf.shape[stack_axis]):
                yield name, i, np.take(leaf, i, axis=stack_axis)


def check_same_architecture(shapes_a: dict, shapes_b: dict, what_a="base", what_b="other") -> None:
    """Raise a ValueError naming the first leaf that differs between two shape maps."""
    only_a = sorted(set(shapes_a) - set(shapes_b))
    only_b = sorted(set(shapes_b) - set(shapes_a))
    if only_a or only_b:
        raise ValueError(
            f"checkpoints have different architectures: {len(only_a)} leaves only in {what_a} "
            f"(e.g. {only_a[:2]}), {len(only_b)} only in {what_b} (e.g. {only_b[:2]}); compare "
            "checkpoints of the same model."
        )
    for name in shapes_a:
        if tuple(shapes_a[name][0]) != tuple(shapes_b[name][0]):
            raise ValueError(
                f"checkpoints have different architectures: {name} is {shapes_a[name][0]} in "
                f"{what_a} but {shapes_b[name][0]} in {what_b}; compare checkpoints of the same "
                "model."
            )


def compare_checkpoints(
    path0: str | os.PathLike,
    path1: str | os.PathLike,
    fn: Callable[[np.ndarray, np.ndarray], dict],
    select: str | Callable[[str], bool] | None = None,
) -> dict[str, dict]:
    """Apply ``fn(w0, w1)`` to every selected 2-D leaf of two checkpoints, one leaf at a time.

    Raises ``ValueError`` when the checkpoints have different architectures.

    Example::

        >>> import jax.numpy as jnp, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> a = save_params(os.path.join(d, "a"), {"w": jnp.ones((2, 2))})
        >>> b = save_params(os.path.join(d, "b"), {"w": 2 * jnp.ones((2, 2))})
        >>> compare_checkpoints(a, b, lambda x, y: float((y - x).sum()))
        {'w': 4.0}
    """
    s0, s1 = checkpoint_shapes(path0), checkpoint_shapes(path1)
    check_same_architecture(s0, s1, str(path0), str(path1))
    keep = _selector(select)
    out = {}
    for name, (shape, _) in s0.items():
        if len(shape) != 2 or not keep(name):
            continue
        out[name] = fn(restore_leaf(path0, name, shapes=s0), restore_leaf(path1, name, shapes=s1))
    return out


def restore_params(path: str | os.PathLike, like) -> dict:
    """Restore a full tree and re-key it like ``like`` (integer layer keys), leaf by leaf.

    Only for small models (the report's head analysis); big models should use the iterators.
    """
    shapes = checkpoint_shapes(path)
    check_same_architecture(params_shapes(like), shapes, "model", str(path))
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for keypath, _ in flat:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
        leaves.append(restore_leaf(path, name, shapes=shapes))
    return jax.tree_util.tree_unflatten(treedef, leaves)


__all__ = [
    "check_same_architecture", "checkpoint_shapes", "compare_checkpoints",
    "iter_checkpoint_matrices", "params_shapes", "restore_leaf", "restore_params", "save_params",
]
