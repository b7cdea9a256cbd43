"""k-means++ seeding and Lloyd iterations in JAX (the one k-means of the package: the k-means
sensitivity baseline of :mod:`lowrank_jax.data.selection` and transport clustering's initialiser).

Example::

    >>> import jax, jax.numpy as jnp
    >>> X = jnp.concatenate([jnp.zeros((5, 2)), jnp.ones((5, 2)) * 10])
    >>> _, labels = kmeans(jax.random.key(0), X, 2)
    >>> bool(labels[0] != labels[-1])
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def kmeans(
    key: jax.Array, A: Float[Array, "n d"], num_clusters: int, *, iterations: int = 25
) -> tuple[Float[Array, "k d"], Int[Array, " n"]]:
    """k-means++ seeding then Lloyd iterations (in-house; jit-able with static sizes).

    Returns ``(centroids [k, d], labels [n])``; an empty cluster keeps its previous centroid.
    """
    if getattr(A, "ndim", None) != 2:
        raise ValueError(f"A must be a 2-D [n, d] matrix, got shape {getattr(A, 'shape', None)}.")
    n = A.shape[0]
    if not isinstance(num_clusters, int) or not 1 <= num_clusters <= n:
        raise ValueError(f"num_clusters={num_clusters!r} must be an int in [1, n={n}].")
    A = jnp.asarray(A, jnp.float32)
    sq = jnp.sum(A * A, axis=1)
    dist2 = lambda C: jnp.maximum(sq[:, None] - 2 * A @ C.T + jnp.sum(C * C, 1)[None], 0.0)
    keys = jax.random.split(key, num_clusters)
    first = A[jax.random.randint(keys[0], (), 0, n)]

    def seed(carry, k):
        centers, closest, i = carry
        j = jax.random.choice(k, n, p=closest / jnp.maximum(jnp.sum(closest), 1e-30))
        centers = centers.at[i].set(A[j])
        closest = jnp.minimum(closest, jnp.sum((A - A[j]) ** 2, axis=1))
        return (centers, closest, i + 1), None

    centers = jnp.zeros((num_clusters, A.shape[1]), jnp.float32).at[0].set(first)
    (centers, _, _), _ = jax.lax.scan(
        seed, (centers, jnp.sum((A - first) ** 2, axis=1), 1), keys[1:])

    def lloyd(centers, _):
        labels = jnp.argmin(dist2(centers), axis=1)
        onehot = jax.nn.one_hot(labels, num_clusters, dtype=jnp.float32)
        counts = onehot.sum(0)
        new = (onehot.T @ A) / jnp.maximum(counts, 1.0)[:, None]
        return jnp.where(counts[:, None] > 0, new, centers), None

    centers, _ = jax.lax.scan(lloyd, centers, None, length=iterations)
    return centers, jnp.argmin(dist2(centers), axis=1)


__all__ = ["kmeans"]
