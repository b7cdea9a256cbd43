"""The one rotary position embedding (RoPE) of the code base, HF Llama "rotate half" pairing.

It lives with the kernels because the xKV decode kernel applies it inside the kernel (keys are
rebuilt from low-rank factors there), and ``pallas_kernels`` never imports ``lowrank_jax``; the
library (models, KV-cache compression) imports it from here.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_inverse_frequencies(head_dim: int, theta: float) -> Float[Array, " half"]:
    """``θ^{-2i/D}`` for ``i < D/2`` (the HF Llama frequencies).

    Example::

        >>> rope_inverse_frequencies(4, 1e4).tolist()
        [1.0, 0.009999999776482582]
    """
    if head_dim % 2:
        raise ValueError(f"rope: head_dim={head_dim} must be even (pairs i and i + D/2).")
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def rope(
    x: Float[Array, "*batch t h d"],
    positions: Int[Array, "*pbatch t"],
    theta: float,
    *,
    dtype=jnp.float32,
) -> Float[Array, "*batch t h d"]:
    """Rotary embedding, HF "rotate half" pairing (dims ``i`` and ``i + D/2``), computed in fp32.

    .. math:: \\mathrm{RoPE}(x)_{t} = [x_1 \\cos\\phi_t - x_2 \\sin\\phi_t,\\;
       x_2 \\cos\\phi_t + x_1 \\sin\\phi_t],\\qquad \\phi_{t,i} = p_t\\,\\theta^{-2i/D}

    Args:
        x: ``[..., t, heads, head_dim]``.
        positions: ``[t]`` (shared by the batch) or ``[batch, t]`` absolute positions.
        theta: RoPE base.
        dtype: output dtype (default float32; ``None`` keeps ``x.dtype``).

    Returns:
        The rotated ``x``.

    Example::

        >>> import jax.numpy as jnp
        >>> x = jnp.array([[[1.0, 0.0]]])  # t=1, h=1, d=2
        >>> rope(x, jnp.array([0]), 1e4).tolist()   # position 0: identity
        [[[1.0, 0.0]]]
    """
    angles = positions.astype(jnp.float32)[..., None] * rope_inverse_frequencies(x.shape[-1], theta)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype if dtype is None else dtype)


__all__ = ["rope", "rope_inverse_frequencies"]
