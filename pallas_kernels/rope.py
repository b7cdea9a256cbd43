"""The one rotary position embedding (RoPE) of the code base, HF Llama "rotate half" pairing.

It lives with the kernels because the xKV decode kernel applies it inside the kernel (keys are
rebuilt from low-rank factors there), and ``pallas_kernels`` never imports ``lowrank_jax``; the
library (models, KV-cache compression) imports it from here.

Checkpoint families change only the frequencies (:func:`rope_frequencies`: Llama 3.x ``llama3``
rescaling, ``linear`` position interpolation, Phi-3 ``longrope`` with its attention factor) and
how many dimensions rotate (``partial_rotary_factor``): :func:`rope` takes the frequencies
(``inv_freq``) and rotates the first ``2 · len(inv_freq)`` dimensions, passing the rest through.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

#: ``rope_type`` values :func:`rope_frequencies` implements (HF ``rope_scaling`` /
#: ``rope_parameters``).
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_inverse_frequencies(head_dim: int, theta: float) -> Float[Array, " half"]:
    """``θ^{-2i/D}`` for ``i < D/2`` (the HF Llama frequencies).

    Example::

        >>> rope_inverse_frequencies(4, 1e4).tolist()
        [1.0, 0.009999999776482582]
    """
    if head_dim % 2:
        raise ValueError(f"rope: head_dim={head_dim} must be even (pairs i and i + D/2).")
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


class RopeFrequencies(NamedTuple):
    """The frequencies of one attention layer (numpy fp32, computed once per config).

    ``inv_freq`` rotates positions below ``original_max_position_embeddings``; ``long_inv_freq``
    (Phi-3 ``longrope`` only, else ``None``) replaces it once a position reaches that length;
    ``attention_scaling`` multiplies cos and sin (HF ``attention_scaling``).
    """

    inv_freq: np.ndarray
    long_inv_freq: np.ndarray | None = None
    original_max_position_embeddings: int | None = None
    attention_scaling: float = 1.0


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    *,
    partial_rotary_factor: float = 1.0,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
) -> RopeFrequencies:
    """RoPE frequencies as transformers computes them (``ROPE_INIT_FUNCTIONS``), in fp32.

    ``dim = int(head_dim · partial_rotary_factor)`` dimensions rotate with
    ``inv = 1 / θ^{2i/dim}``; ``scaling`` (a HF ``rope_scaling`` dict, ``rope_type`` or ``type``)
    then rescales them:

    - ``linear``: ``inv / factor``;
    - ``llama3``: wavelengths ``2π/inv`` above ``old_ctx / low_freq_factor`` divided by
      ``factor``, below ``old_ctx / high_freq_factor`` kept, smoothly interpolated between;
    - ``longrope``: ``inv / short_factor`` (``long_factor`` past the original context), and
      ``attention_factor = sqrt(1 + ln(s) / ln(old_ctx))`` with
      ``s = max_position_embeddings / old_ctx`` unless the dict gives it.

    Args:
        head_dim: per-head size.
        theta: the RoPE base.
        scaling: ``None`` / ``{"rope_type": "default"}`` or one of :data:`ROPE_TYPES`.
        partial_rotary_factor: fraction of ``head_dim`` that rotates (Phi-3.5/4-mini).
        max_position_embeddings, original_max_position_embeddings: the config's (longrope).

    Returns:
        A :class:`RopeFrequencies`.

    Example::

        >>> f = rope_frequencies(16, 5e5, {"rope_type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        ...     "original_max_position_embeddings": 8192})
        >>> f.inv_freq.shape, float(f.inv_freq[0]), f.attention_scaling
        ((8,), 1.0, 1.0)
    """
    dim = int(head_dim * partial_rotary_factor)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"rope: head_dim={head_dim} x partial_rotary_factor={partial_rotary_factor} = {dim} "
            "rotary dimensions; it must be a positive even number."
        )
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={kind!r} is not implemented; implemented: "
                         f"{', '.join(ROPE_TYPES)}.")

    def need(key):
        if scaling.get(key) is None:
            raise ValueError(f"rope_scaling (rope_type={kind!r}) needs {key!r}; got {scaling}.")
        return scaling[key]

    if kind == "default":
        return RopeFrequencies(inv)
    if kind == "linear":
        return RopeFrequencies((inv / np.float32(need("factor"))).astype(np.float32))
    if kind == "llama3":
        factor, low, high = (float(need(k)) for k in ("factor", "low_freq_factor",
                                                       "high_freq_factor"))
        old_ctx = float(need("original_max_position_embeddings"))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wl = 2 * math.pi / inv
        inv_l = np.where(wl > low_wl, inv / factor, inv)
        smooth = (old_ctx / wl - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        return RopeFrequencies(np.where(medium, smoothed, inv_l).astype(np.float32))
    # longrope (Phi-3): the config's original context, else the dict's, else max positions
    old_ctx = (original_max_position_embeddings or scaling.get("original_max_position_embeddings")
               or max_position_embeddings)
    if old_ctx is None:
        raise ValueError("rope_scaling (rope_type='longrope') needs "
                         "original_max_position_embeddings or max_position_embeddings.")
    factor = scaling.get("factor")
    if original_max_position_embeddings and max_position_embeddings:
        factor = max_position_embeddings / original_max_position_embeddings
    factor = 1.0 if factor is None else float(factor)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(old_ctx)))
    base = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    short = np.asarray(need("short_factor"), np.float32)
    long = np.asarray(need("long_factor"), np.float32)
    for name, value in (("short_factor", short), ("long_factor", long)):
        if value.shape != (dim // 2,):
            raise ValueError(f"rope_scaling.{name} has {value.size} entries; longrope needs "
                             f"rotary_dim / 2 = {dim // 2}.")
    return RopeFrequencies((1.0 / (short * base)).astype(np.float32),
                           (1.0 / (long * base)).astype(np.float32), int(old_ctx),
                           float(attention_factor))


def rope(
    x: Float[Array, "*batch t h d"],
    positions: Int[Array, "*pbatch t"],
    theta: float | None = None,
    *,
    dtype=jnp.float32,
    inv_freq=None,
    attention_scaling: float = 1.0,
) -> Float[Array, "*batch t h d"]:
    """Rotary embedding, HF "rotate half" pairing (dims ``i`` and ``i + R/2``), computed in fp32.

    .. math:: \\mathrm{RoPE}(x)_{t} = [x_1 \\cos\\phi_t - x_2 \\sin\\phi_t,\\;
       x_2 \\cos\\phi_t + x_1 \\sin\\phi_t],\\qquad \\phi_{t,i} = p_t\\,\\theta^{-2i/D}

    Args:
        x: ``[..., t, heads, head_dim]``.
        positions: ``[t]`` (shared by the batch) or ``[batch, t]`` absolute positions.
        theta: RoPE base (plain frequencies over all of ``head_dim``); or give ``inv_freq``.
        dtype: output dtype (default float32; ``None`` keeps ``x.dtype``).
        inv_freq: ``[R/2]`` frequencies (e.g. :func:`rope_frequencies`); only the first ``R``
            dimensions rotate, the rest pass through (partial rotary).
        attention_scaling: factor on cos and sin (Phi-3 longrope).

    Returns:
        The rotated ``x``.

    Example::

        >>> import jax.numpy as jnp
        >>> x = jnp.array([[[1.0, 0.0]]])  # t=1, h=1, d=2
        >>> rope(x, jnp.array([0]), 1e4).tolist()   # position 0: identity
        [[[1.0, 0.0]]]
    """
    if inv_freq is None:
        if theta is None:
            raise ValueError("rope: give theta (the RoPE base) or inv_freq.")
        inv_freq = rope_inverse_frequencies(x.shape[-1], theta)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    rot = 2 * inv_freq.shape[-1]
    if rot > x.shape[-1]:
        raise ValueError(f"rope: {inv_freq.shape[-1]} frequencies rotate {rot} dimensions but "
                         f"head_dim is {x.shape[-1]}.")
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :rot], 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rot:]], axis=-1)
    return out.astype(x.dtype if dtype is None else dtype)


__all__ = ["ROPE_TYPES", "RopeFrequencies", "rope", "rope_frequencies",
           "rope_inverse_frequencies"]
