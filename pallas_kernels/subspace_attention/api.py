"""Public dual-stream subspace attention: ``implementation="auto"|"pallas"|"xla"``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from pallas_kernels import _dispatch
from pallas_kernels._dispatch import IMPLEMENTATIONS, implementation_of
from pallas_kernels.flash_attention.api import padded_head_dim
from pallas_kernels.subspace_attention import kernel as _kernel
from pallas_kernels.subspace_attention.reference import (
    check_subspace_shapes,
    lookup_tables,
    subspace_attention_blocked,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Token blocks of the near/far decision and of the kernel tiles.

    ``block_q`` query rows and ``block_k`` keys per tile; both powers of two ≥ 8 (checked once,
    here; see the tiling policy of :mod:`pallas_kernels._dispatch`). The near mask is defined on
    these blocks, so they are never fitted: they are part of the result. A frame of
    ``H·W`` tokens is one block when ``block_k == H·W`` (frame-aligned windows).

    Example::

        >>> BlockSizes(16, 16).block_k
        16
    """

    block_q: int = 64
    block_k: int = 64


def subspace_attention(
    q: Float[Array, "b n h d"],
    k: Float[Array, "b n h d"],
    v: Float[Array, "b n h d"],
    q_lat: Float[Array, "b n h r"],
    k_lat: Float[Array, "b n h r"],
    v_lat: Float[Array, "b n h rv"],
    v_basis: Float[Array, "h d rv"],
    near_mask: Bool[Array, "nq nk"],
    *,
    block_sizes: BlockSizes | None = None,
    scale: float | None = None,
    v_residual: str = "latent",
    implementation: str = "auto",
    interpret: Any = None,
    platform: str | None = None,
) -> Float[Array, "b n h d"]:
    """Bidirectional attention with an exact stream on near blocks and a subspace stream elsewhere.

    .. math:: O = P_{\\text{near}} V + (P_{\\text{far}} \\tilde V) E_v^\\top,\\quad
       P = \\mathrm{softmax}\\big(c\\,[Q K^\\top]_{\\text{near}} + c\\,[\\tilde Q\\tilde K^\\top]
       _{\\text{far}}\\big),

    one softmax over all keys (see :func:`subspace_attention_reference`). With full-rank bases
    (``q̃ k̃ᵀ = q kᵀ``, ``E_v E_vᵀ = I``) it equals dense attention for any near mask.

    Backends: on GPU the kernel lowers to **Triton**, chosen explicitly (Triton
    ``CompilerParams``): it slices the head's whole-sequence K/V streams inside ``fori_loop`` loops
    (pointer loads), which Mosaic GPU would stage whole in shared memory. On TPU (Mosaic) the
    lookup tables are SMEM blocks and the streams stay resident in VMEM (about 16K tokens per
    device at head_dim 128).

    Args:
      q, k, v: ``[batch, n, heads, head_dim]``.
      q_lat, k_lat: ``[batch, n, heads, rank]``; v_lat: ``[batch, n, heads, rank_v]``.
      v_basis: ``[heads, head_dim, rank_v]``.
      near_mask: ``[ceil(n/block_q), ceil(n/block_k)]`` bool (True = exact stream).
      block_sizes: the blocks ``near_mask`` is defined on; default :meth:`BlockSizes.get_default`.
      scale: logit scale (default ``head_dim ** -0.5``).
      v_residual: ``"latent"`` or ``"far_exact"`` (far blocks use exact ``v``).
      implementation: ``"pallas"``, ``"xla"`` (:func:`subspace_attention_blocked`, which skips the
        exact stream on far blocks) or ``"auto"``.
      interpret: passed to ``pallas_call``; ``None`` means ``True`` on CPU.
      platform: ``"gpu"``, ``"tpu"`` or ``"interpret"``; default from the backend.

    Returns:
      ``[batch, n, heads, head_dim]`` in ``q.dtype``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 40, 2, 16))
        >>> basis = jnp.broadcast_to(jnp.eye(16), (2, 16, 16))
        >>> mask = jnp.eye(3, dtype=bool)
        >>> o = subspace_attention(q, k, v, q, k, v, basis, mask, block_sizes=BlockSizes(16, 16),
        ...                        implementation="pallas", interpret=True)
        >>> o.shape
        (1, 40, 2, 16)
    """
    block_sizes = BlockSizes.check("subspace_attention", block_sizes)
    bq, bk = block_sizes.block_q, block_sizes.block_k
    b, n, h, d, rank, rank_v = check_subspace_shapes(
        q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask, block_q=bq, block_k=bk,
        v_residual=v_residual)
    scale = d ** -0.5 if scale is None else float(scale)
    if implementation_of(implementation, interpret) == "xla":
        max_near = None
        try:
            max_near = max(int(jnp.max(jnp.sum(jnp.asarray(near_mask), axis=-1))), 1)
        except jax.errors.ConcretizationTypeError:  # traced mask: gather every block
            max_near = near_mask.shape[-1]
        return subspace_attention_blocked(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask,
                                          block_q=bq, block_k=bk, scale=scale,
                                          v_residual=v_residual, max_near=max_near)
    platform = platform or _dispatch.backend_platform()
    if platform not in _kernel.PLATFORMS:
        raise ValueError(f"platform={platform!r} is unknown; choose one of {_kernel.PLATFORMS}.")
    if interpret is None:
        interpret = platform == "interpret"
    if platform == "interpret" and not interpret:
        raise ValueError(
            "subspace_attention: Pallas kernels run on CPU only in interpret mode; pass "
            "interpret=True or implementation='xla'."
        )
    return _subspace_pallas(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask, block_q=bq,
                            block_k=bk, scale=scale, latent=v_residual == "latent",
                            platform=platform, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "scale", "latent", "platform",
                                             "interpret"))
def _subspace_pallas(q, k, v, q_lat, k_lat, v_lat, v_basis, near_mask, *, block_q, block_k, scale,
                     latent, platform, interpret):
    b, n, h, d = q.shape
    tile = max(block_q, block_k)
    n_pad = -(-n // tile) * tile
    n_q, n_k = n_pad // block_q, n_pad // block_k
    mask = jnp.pad(jnp.asarray(near_mask, bool),
                   ((0, n_q - near_mask.shape[0]), (0, n_k - near_mask.shape[1])))
    near_lut, near_counts, far_lut, far_counts = lookup_tables(mask)

    def prep(x):  # [b, n, h, f] -> zero-padded head-major [b, h, n_pad, f_pad]
        f = x.shape[-1]
        x = jnp.pad(x.astype(q.dtype), ((0, 0), (0, n_pad - n), (0, 0),
                                        (0, padded_head_dim(f) - f)))
        return jnp.transpose(x, (0, 2, 1, 3))

    rv = v_lat.shape[-1]
    basis = jnp.pad(v_basis.astype(q.dtype),
                    ((0, 0), (0, padded_head_dim(d) - d), (0, padded_head_dim(rv) - rv)))
    out = _kernel.dual_stream_attention(
        prep(q), prep(k), prep(v), prep(q_lat), prep(k_lat), prep(v_lat), basis, near_lut,
        near_counts, far_lut, far_counts, block_q=block_q, block_k=block_k, n=n, scale=scale,
        latent_values=latent, platform=platform, interpret=interpret)
    return jnp.transpose(out, (0, 2, 1, 3))[:, :n, :, :d]


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "implementation_of", "subspace_attention"]
