"""Public SALE sparse prefill attention.

The attention-dispatcher entry ``"sale"`` lives in :mod:`lowrank_jax.attention.kernels`
(kernels never import the library).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from pallas_kernels.flash_attention.api import (
    flash_attention,
    padded_head_dim,
    resolve_implementation,
)
from pallas_kernels import _dispatch
from pallas_kernels._dispatch import inference_only
from pallas_kernels.flash_attention.reference import check_attention_shapes
from pallas_kernels.sparse_attention import kernel as _kernel
from pallas_kernels.sparse_attention.reference import (
    SaleConfig,
    anchor_stats,
    causal_block_mask,
    combine_selection,
    quantize_qk_int4,
    sale_prefill_reference,
    selection_thresholds,
)

#: The repo README's example threshold, used when no calibrated per-head τ is given.
DEFAULT_TAU = 0.004


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Tiles of the SALE kernels: ``block_q`` query rows and ``block_k`` keys per tile.

    Powers of two ≥ 8, checked once here (the tiling policy of :mod:`pallas_kernels._dispatch`).
    Each ``block_k`` keys get one selection bit, so the tiles are part of the result and are
    never fitted (a short sequence pads to them). They are the tiles of a :class:`SaleConfig`
    (``block_q``, ``block_k``, default 64 × 32, the repo's); :func:`sale_prefill_attention`'s
    ``block_sizes=`` replaces the config's two tiles (:meth:`of` reads them back).

    Example::

        >>> BlockSizes(block_q=16, block_k=16).apply(SaleConfig(block_seg=32)).block_k
        16
        >>> BlockSizes.of(SaleConfig())
        BlockSizes(block_q=64, block_k=32)
    """

    block_q: int = 64
    block_k: int = 32

    @classmethod
    def of(cls, cfg: SaleConfig) -> "BlockSizes":
        """The tiles of ``cfg``."""
        return cls(cfg.block_q, cfg.block_k)

    def apply(self, cfg: SaleConfig) -> SaleConfig:
        """``cfg`` with these tiles (its checks apply: ``block_seg`` a multiple of ``block_k``)."""
        return dataclasses.replace(cfg, block_q=self.block_q, block_k=self.block_k)


def _tau_vector(tau, heads: int) -> jnp.ndarray:
    tau = jnp.asarray(tau, jnp.float32)
    if tau.ndim == 0:
        tau = jnp.full((heads,), tau)
    if tau.shape != (heads,):
        raise ValueError(
            f"sale: tau has shape {tau.shape}; pass a scalar or one threshold per query head "
            f"({heads},)."
        )
    try:
        concrete = np.asarray(tau)
    except jax.errors.TracerArrayConversionError:  # traced τ (e.g. under jit): no value check
        return tau
    if np.any(concrete < 0) or np.any(np.isnan(concrete)):
        raise ValueError(f"sale: thresholds tau={concrete} must be >= 0 (0 = dense head).")
    return tau


def lookup_table(block_mask: Bool[Array, "B H nQ nK"]):
    """``(lut [B, H, nQ, nK], counts [B, H, nQ])`` int32: selected block ids first, ascending."""
    n_k = block_mask.shape[-1]
    order = jnp.argsort(~block_mask, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.sum(block_mask, axis=-1).astype(jnp.int32)
    # slots past the count repeat the last selected id (no new DMA in the TPU kernel)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    slot = jnp.arange(n_k)[None, None, None, :]
    return jnp.where(slot < counts[..., None], order, last), counts


@functools.partial(jax.jit, static_argnames=("cfg", "scale", "platform", "interpret"))
def _sale_pallas(qh, kh, vh, tau, *, cfg, scale, platform, interpret):
    """Selection + block-sparse kernels on head-major inputs; returns ``(out [b,n,h,d], mask)``."""
    b, h, n, d = qh.shape
    bq, bk = cfg.block_q, cfg.block_k
    n_pad = -(-n // max(bq, bk)) * max(bq, bk)
    d_pad = padded_head_dim(d)

    qk4 = quantize_qk_int4(qh, kh, cfg.granularity)
    m, l = anchor_stats(qh, qk4.k_centred, cfg, scale=scale)
    thresholds = selection_thresholds(m, l, tau, scale)

    def pad_rows(x, value=0):
        widths = [(0, 0)] * x.ndim
        widths[2] = (0, n_pad - n)
        return jnp.pad(x, widths, constant_values=value)

    def pad_dim(x):
        return jnp.pad(pad_rows(x), ((0, 0), (0, 0), (0, 0), (0, d_pad - d)))

    statics = dict(block_q=bq, block_k=bk, n=n, interpret=interpret)
    hits = _kernel.sale_select(
        pad_dim(qk4.q_codes), pad_rows(qk4.q_scale)[..., None],
        pad_rows(thresholds, jnp.inf)[..., None], pad_dim(qk4.k_codes),
        pad_rows(qk4.k_scale)[:, :, None, :], pad_rows(qk4.qmk)[:, :, None, :],
        local_blocks=cfg.local_blocks, blocks_per_segment=cfg.blocks_per_segment,
        platform=platform, **statics)
    n_k, n_q = -(-n // bk), -(-n // bq)
    mask = combine_selection(hits[:, :, :n_q, :n_k], tau, n, cfg)
    lut, counts = lookup_table(mask)
    # queries padded to n_pad may add whole query blocks past n_q: give them the sink block
    lut = jnp.pad(lut, ((0, 0), (0, 0), (0, n_pad // bq - n_q), (0, n_pad // bk - n_k)),
                  mode="edge")
    counts = jnp.pad(counts, ((0, 0), (0, 0), (0, n_pad // bq - n_q)), constant_values=1)
    sparse = _kernel.block_sparse_attention_tpu if platform == "tpu" else (
        _kernel.block_sparse_attention)
    out = sparse(pad_dim(qh), pad_dim(kh.astype(qh.dtype)), pad_dim(vh.astype(qh.dtype)), lut,
                 counts, scale=scale, platform=platform, **statics)
    return jnp.transpose(out[:, :, :n, :d], (0, 2, 1, 3)), mask


def sale_prefill_attention(
    q: Float[Array, "b n h d"],
    k: Float[Array, "b n hk d"],
    v: Float[Array, "b n hk d"],
    tau: Any = DEFAULT_TAU,
    cfg: SaleConfig | None = None,
    *,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    implementation: str = "auto",
    interpret: Any = None,
    platform: str | None = None,
    return_mask: bool = False,
):
    """Causal prefill attention that computes only the key blocks SALE selects.

    Steps (spec sections 1–5): centre and 4-bit-quantize Q, K; exact anchor statistics ``m, l``
    over the sink + local blocks; log-domain thresholds ``T_i = m_i + ln(τ_h l_i)/c``; a key
    block is kept when some pair in its tile has ``ŝ_ij > T_i`` (equivalently
    ``RAS_ij = exp(c(ŝ_ij − m_i))/l_i > τ_h``); block-sparse flash attention over anchor ∪ kept.
    Heads with ``τ_h < cfg.dense_tau`` (e.g. 0) and sequences with ``N ≤ cfg.dense_below``
    are dense.

    Backends: on GPU both kernels lower to **Triton**, chosen explicitly (Triton
    ``CompilerParams``): they slice whole-sequence K/V blocks inside ``fori_loop`` loops (pointer
    loads), which Mosaic GPU would stage whole in shared memory. On TPU the selection kernel is
    the same body and the sparse pass a splash-style Mosaic kernel (scalar-prefetched lookup
    table in SMEM-sized chunks, K/V streamed block by block).

    Args:
      q: ``[batch, n, heads, head_dim]`` (the dispatcher layout).
      k, v: ``[batch, n, kv_heads, head_dim]``.
      tau: scalar or ``[heads]`` thresholds (per layer, from :func:`calibrate_thresholds`).
      cfg: :class:`SaleConfig` (default: the repo's 64×32 tiles, 128 local window).
      scale: logit scale ``c`` (default ``head_dim ** -0.5``).
      block_sizes: :class:`BlockSizes` replacing ``cfg``'s tiles (default: ``cfg``'s).
      implementation: ``"pallas"``, ``"xla"`` (jnp reference) or ``"auto"``.
      interpret: Pallas interpret mode (``None``: on CPU only).
      platform: ``"gpu"``, ``"tpu"`` or ``"interpret"`` (default from the backend).
      return_mask: also return the ``[batch, heads, nQ, nK]`` block mask.

    Returns:
      ``[batch, n, heads, head_dim]`` (and the block mask when ``return_mask``).

    Example::

        >>> import jax
        >>> q = jax.random.normal(jax.random.key(0), (1, 48, 2, 16))
        >>> k = v = jax.random.normal(jax.random.key(1), (1, 48, 1, 16))
        >>> cfg = SaleConfig(block_q=16, block_k=16, block_seg=16, local_window=16, dense_below=0)
        >>> out, mask = sale_prefill_attention(q, k, v, 0.0, cfg, implementation="xla",
        ...                                    return_mask=True)
        >>> bool(mask.all(axis=(0, 1)).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
        True

    References:
      Ji et al., SALE, https://arxiv.org/abs/2505.24179
    """
    cfg = SaleConfig() if cfg is None else cfg
    if block_sizes is not None:
        cfg = BlockSizes.check("sale_prefill_attention", block_sizes).apply(cfg)
    b, n, n_k_len, h, hk, d = check_attention_shapes(q, k, v, name="sale_prefill_attention")
    if n != n_k_len:
        raise ValueError(
            f"sale_prefill_attention: q has {n} positions but k has {n_k_len}; SALE is a "
            "causal prefill kernel and needs equal lengths (use the reference for decode)."
        )
    tau = _tau_vector(tau, h)
    scale = d ** -0.5 if scale is None else float(scale)
    impl = resolve_implementation(implementation, interpret)
    if n <= cfg.dense_below:
        out = flash_attention(q, k, v, causal=True, scale=scale, implementation=impl,
                              interpret=interpret, platform=platform)
        if return_mask:
            dense = jnp.broadcast_to(jnp.asarray(causal_block_mask(n, cfg)), (b, h) + (
                causal_block_mask(n, cfg).shape))
            return out, dense
        return out

    qh, kh, vh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))
    if impl == "xla":
        out, mask = sale_prefill_reference(qh, kh, vh, tau, cfg, scale=scale, return_mask=True)
        out = jnp.transpose(out, (0, 2, 1, 3))
        return (out, mask) if return_mask else out

    platform = platform or _dispatch.backend_platform()
    if interpret is None:
        interpret = platform == "interpret"
    if platform == "interpret" and not interpret:
        raise ValueError("sale_prefill_attention: on CPU pass interpret=True or "
                         "implementation='xla'.")
    kernel = functools.partial(_sale_pallas, cfg=cfg, scale=scale, platform=platform,
                               interpret=interpret)
    out, mask = inference_only("sale_prefill_attention", kernel, qh, kh, vh, tau)
    return (out, mask) if return_mask else out


__all__ = ["DEFAULT_TAU", "BlockSizes", "lookup_table", "sale_prefill_attention"]
