"""The package's one next-token cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets):
    """Mean next-token cross entropy in nats (fp32).

    Example::

        >>> import jax.numpy as jnp
        >>> round(float(cross_entropy(jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), jnp.int32))), 4)
        1.3863
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


__all__ = ["cross_entropy"]
