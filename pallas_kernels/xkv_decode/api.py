"""Public entry point: decode attention over an xKV-compressed cache plus an exact tail."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import _dispatch
from pallas_kernels._dispatch import inference_only, resolve
from pallas_kernels.xkv_decode.kernel import xkv_decode_partials
from pallas_kernels.xkv_decode.reference import NEG_INF, xkv_decode_reference

#: ``implementation=`` values: ``auto`` (Pallas on GPU/TPU, else XLA), ``pallas``, ``xla``.
from pallas_kernels._dispatch import IMPLEMENTATIONS  # noqa: E402 (re-export)


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Tiling of the xKV decode kernel: ``block_k`` prompt tokens per block (a power of two
    ≥ 8, checked once here) and ``num_splits`` split-K partitions of the prompt
    (flash-decoding; a positive count).

    The tiles do not change the result: ``block_k`` fits a shorter prompt (the one fit rule,
    :func:`~pallas_kernels._dispatch.fit_tile`), the prompt is padded and masked to
    ``splits · blocks · block_k``, and ``num_splits`` is capped at the number of blocks.

    Example::

        >>> BlockSizes(block_k=16, num_splits=3)
        BlockSizes(block_k=16, num_splits=3)
    """

    block_k: int = 128
    num_splits: int = _dispatch.count_field(4)


def _check(q, key_factor, key_basis, value_factor, value_basis, tail_keys, tail_values):
    b, hq, d = q.shape
    if key_factor.ndim != 3 or key_factor.shape[0] != b:
        raise ValueError(f"key_factor has shape {key_factor.shape}; expected [b={b}, L, rank].")
    hk = key_basis.shape[1]
    if key_basis.shape != (b, hk, key_factor.shape[2], d):
        raise ValueError(
            f"key_basis has shape {key_basis.shape}; expected [b, kv_heads, "
            f"{key_factor.shape[2]}, {d}] to match key_factor {key_factor.shape} and q {q.shape}."
        )
    if hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of the {hk} KV heads of key_basis.")
    if d % 2:
        raise ValueError(f"head_dim={d} must be even for RoPE.")
    if value_factor.shape[:2] != key_factor.shape[:2]:
        raise ValueError(
            f"value_factor {value_factor.shape} and key_factor {key_factor.shape} must share "
            "[batch, prompt_length]."
        )
    if value_basis.shape != (b, hk, value_factor.shape[2], d):
        raise ValueError(
            f"value_basis has shape {value_basis.shape}; expected "
            f"{(b, hk, value_factor.shape[2], d)}."
        )
    if (tail_keys is None) != (tail_values is None):
        raise ValueError("tail_keys and tail_values must be given together (or both None).")
    if tail_keys is not None and (tail_keys.shape != tail_values.shape
                                  or tail_keys.shape[0] != b or tail_keys.shape[2:] != (hk, d)):
        raise ValueError(
            f"tail_keys {tail_keys.shape} / tail_values {tail_values.shape} must both be "
            f"[{b}, T, {hk}, {d}]."
        )


def _resolve(implementation: str, interpret):
    return resolve(implementation, interpret, op="xkv_decode_attention")


def xkv_decode_attention(
    q: Float[Array, "b hq d"],
    key_factor: Float[Array, "b L rk"],
    key_basis: Float[Array, "b hk rk d"],
    value_factor: Float[Array, "b L rv"],
    value_basis: Float[Array, "b hk rv d"],
    *,
    rope_theta: float,
    tail_keys: Float[Array, "b T hk d"] | None = None,
    tail_values: Float[Array, "b T hk d"] | None = None,
    tail_length=None,
    scale: float | None = None,
    implementation: str = "auto",
    interpret=None,
    block_sizes: BlockSizes | None = None,
) -> Float[Array, "b hq d"]:
    """Attention of one new query per sequence over ``[RoPE(A_k B_k) | K_tail]``.

    .. math::

        o = \\frac{\\sum_{t<L} e^{s_t-m}\\,(A_v[t]) B_{v,h} + \\sum_{j<T} e^{s_j-m} V_{tail,j}}
                 {\\sum_{t<L} e^{s_t-m} + \\sum_{j<T} e^{s_j-m}},\\quad
        s_t = q\\cdot\\mathrm{RoPE}(A_k[t] B_{k,h}, t)/\\sqrt{D}

    The prompt part runs in the Pallas kernel (keys rebuilt per block, values accumulated in
    the rank-``r_v`` space, split-K); the short exact tail and the log-sum-exp merge run in XLA.

    Args:
        q: post-RoPE query of the new token, ``[b, q_heads, head_dim]``.
        key_factor: pre-RoPE key token factor ``A_k`` ``[b, L, rank_k]`` (prompt token ``t`` at
            position ``t``).
        key_basis: per-KV-head key basis ``[b, kv_heads, rank_k, head_dim]``.
        value_factor: ``A_v`` ``[b, L, rank_v]``.
        value_basis: ``[b, kv_heads, rank_v, head_dim]``.
        rope_theta: RoPE base of the model.
        tail_keys, tail_values: exact post-RoPE keys/values of the generated tokens
            ``[b, T, kv_heads, head_dim]`` (preallocated; only ``tail_length`` rows count).
        tail_length: valid tail rows (int or scalar array; default all ``T``).
        scale: softmax scale, default ``head_dim ** -0.5``.
        implementation: ``"auto"`` (Pallas on GPU/TPU, XLA on CPU), ``"pallas"`` or ``"xla"``
            (the pure-jnp reference).
        interpret: Pallas interpret mode; default True on CPU, False elsewhere.
        block_sizes: :class:`BlockSizes` (``block_k`` prompt tokens per kernel block,
            ``num_splits`` split-K partitions); default ``BlockSizes()``.

    Returns:
        ``[b, q_heads, head_dim]`` in fp32.

    Example::

        >>> import jax.numpy as jnp
        >>> out = xkv_decode_attention(jnp.ones((1, 4, 8)), jnp.ones((1, 5, 3)),
        ...     jnp.ones((1, 2, 3, 8)), jnp.ones((1, 5, 3)), jnp.ones((1, 2, 3, 8)),
        ...     rope_theta=1e4, implementation="pallas", interpret=True,
        ...     block_sizes=BlockSizes(block_k=16))
        >>> out.shape
        (1, 4, 8)

    References:
        Chang et al, `xKV: Cross-Layer KV-Cache Compression via Aligned Singular Vector
        Extraction <https://arxiv.org/abs/2503.18893>`_, 2025.
    """
    _check(q, key_factor, key_basis, value_factor, value_basis, tail_keys, tail_values)
    blocks = BlockSizes.check("xkv_decode_attention", block_sizes)
    implementation, interpret = _resolve(implementation, interpret)
    if tail_keys is not None and tail_length is None:
        tail_length = tail_keys.shape[1]
    return _attention(
        q, key_factor, key_basis, value_factor, value_basis, tail_keys, tail_values,
        tail_length, rope_theta=float(rope_theta),
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        implementation=implementation, interpret=interpret,
        block_k=_dispatch.fit_tile(blocks.block_k, key_factor.shape[1]),
        num_splits=blocks.num_splits,
    )


@functools.partial(jax.jit, static_argnames=(
    "rope_theta", "scale", "implementation", "interpret", "block_k", "num_splits"))
def _attention(q, key_factor, key_basis, value_factor, value_basis, tail_keys, tail_values,
               tail_length, *, rope_theta, scale, implementation, interpret, block_k,
               num_splits):
    b, hq, d = q.shape
    hk = key_basis.shape[1]
    groups = hq // hk
    if implementation == "xla":
        return xkv_decode_reference(
            q, key_factor, key_basis, value_factor, value_basis, rope_theta=rope_theta,
            tail_keys=tail_keys, tail_values=tail_values, tail_length=tail_length, scale=scale,
            value_path="latent",
        )
    kernel = functools.partial(xkv_decode_partials, rope_theta=float(rope_theta), scale=scale,
                               block_k=block_k, num_splits=num_splits, interpret=interpret)
    o_lat, m, l = inference_only("xkv_decode_attention", kernel, q, key_factor, key_basis,
                                 value_factor)
    o = jnp.einsum("bhgr,bhrd->bhgd", o_lat, value_basis.astype(jnp.float32))
    if tail_keys is not None:
        t = tail_keys.shape[1]
        qg = q.astype(jnp.float32).reshape(b, hk, groups, d)
        s = jnp.einsum("bhgd,bthd->bhgt", qg, tail_keys.astype(jnp.float32)) * scale
        valid = jnp.arange(t) < tail_length
        s = jnp.where(valid, s, NEG_INF)
        m_t = jnp.max(s, axis=-1)
        p = jnp.where(valid, jnp.exp(s - m_t[..., None]), 0.0)
        m_new = jnp.maximum(m, m_t)
        a, c = jnp.exp(m - m_new), jnp.exp(m_t - m_new)
        l = a * l + c * jnp.sum(p, axis=-1)
        o = a[..., None] * o + c[..., None] * jnp.einsum(
            "bhgt,bthd->bhgd", p, tail_values.astype(jnp.float32))
    out = o / jnp.where(l == 0, 1.0, l)[..., None]
    return out.reshape(b, hq, d)


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "xkv_decode_attention"]
