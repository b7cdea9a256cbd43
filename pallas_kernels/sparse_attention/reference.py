"""SALE (low-bit estimation for sparse prefill attention): pure-jnp reference of every pass.

Head-major layout as in the spec: ``q [B, Hq, N, D]``, ``k, v [B, Hkv, N, D]`` with
``Hq % Hkv == 0``. Prefill is causal. The passes:

1. :func:`quantize_qk_int4` — centre Q and K per head over the sequence, symmetric 4-bit codes.
2. :func:`estimated_logits` — ``ŝ_ij = s^q_i s^k_j (Q̂_i·K̂_j) + q̄·K̃_j`` (exact integer dot).
3. :func:`anchor_block_mask` / :func:`anchor_stats` — exact row max ``m`` and sum ``l`` over the
   sink block + local window ending at the diagonal.
4. :func:`sale_select_reference` — keep key block b for query block i when some pair has
   ``RAS_ij = exp(c(ŝ_ij − m_i)) / l_i > τ_h``, i.e. ``ŝ_ij > T_i = m_i + ln(τ_h l_i)/c``.
5. :func:`block_sparse_attention_reference` — dense softmax attention under the block mask.

References:
  Ji, Zhang, Fu, Cui, "SALE: Low-bit Estimation for Efficient Sparse Attention in Long-context
  LLM Prefilling", https://arxiv.org/abs/2505.24179 (code: github.com/BirdChristopher/SALE)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int8

from pallas_kernels.flash_attention.reference import MASK_VALUE  # noqa: E402 (one value)
GRANULARITIES = ("per_token", "per_block")


@dataclasses.dataclass(frozen=True)
class SaleConfig:
    """Block geometry and defaults of SALE (the repo's defaults, see the spec's table).

    Attributes:
      block_q: query rows per selection/computation tile (repo: 64).
      block_k: keys per tile; each key block gets its own selection bit (repo: 32).
      block_seg: middle key blocks come in segments of ``block_seg / block_k`` (repo: 128).
      local_window: minimum local window in tokens, always computed (repo: 128).
      granularity: ``"per_token"`` (one scale per row) or ``"per_block"`` (16 query rows / 8 keys).
      dense_below: sequences with ``N <= dense_below`` use dense attention (repo: 1024).
      dense_tau: heads with ``τ < dense_tau`` are dense (repo: 1e-5).

    Example::

        >>> SaleConfig(block_q=16, block_k=16, block_seg=32, local_window=32).blocks_per_segment
        2
    """

    block_q: int = 64
    block_k: int = 32
    block_seg: int = 128
    local_window: int = 128
    granularity: str = "per_token"
    dense_below: int = 1024
    dense_tau: float = 1e-5

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_seg", "local_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SaleConfig.{name}={value!r} must be a positive int.")
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value & (value - 1) or value < 8:
                raise ValueError(
                    f"SaleConfig.{name}={value} must be a power of two >= 8 (kernel tile rule)."
                )
        if self.block_seg % self.block_k:
            raise ValueError(
                f"SaleConfig.block_seg={self.block_seg} must be a multiple of "
                f"block_k={self.block_k}."
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"SaleConfig.granularity={self.granularity!r}; choose one of {GRANULARITIES}."
            )

    @property
    def blocks_per_segment(self) -> int:
        return self.block_seg // self.block_k

    @property
    def local_blocks(self) -> int:
        return -(-self.local_window // self.block_k)


class QK4(NamedTuple):
    """Centred 4-bit Q/K codes (values in [−7, 7] stored as int8), scales and the correction."""

    q_codes: Int8[Array, "B Hq N D"]
    q_scale: Float[Array, "B Hq N"]
    k_codes: Int8[Array, "B Hkv N D"]
    k_scale: Float[Array, "B Hkv N"]
    qmk: Float[Array, "B Hq N"]  # q̄_h · K̃_j
    k_centred: Float[Array, "B Hkv N D"]


def quantize_int4_symmetric(x, group_rows: int | None = None):
    """Symmetric 4-bit codes ``x̂ = round(x/s) ∈ [−7, 7]`` with ``s = max|x| / 7`` per group.

    ``group_rows=None``: one scale per row (last axis); otherwise one scale per ``group_rows``
    consecutive rows (axis −2) and all columns. An all-zero group gets ``s = 0`` and codes 0.
    Returns ``(codes int8, scale fp32 [..., rows])``.
    """
    x = x.astype(jnp.float32)
    if group_rows is None:
        amax = jnp.max(jnp.abs(x), axis=-1)
    else:
        n = x.shape[-2]
        pad = -n % group_rows
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)])
        grouped = xp.reshape(*x.shape[:-2], (n + pad) // group_rows, group_rows * x.shape[-1])
        amax = jnp.repeat(jnp.max(jnp.abs(grouped), axis=-1), group_rows, axis=-1)[..., :n]
    scale = amax / 7.0
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(x / safe[..., None]), -7, 7).astype(jnp.int8)
    return codes, scale


def quantize_qk_int4(
    q: Float[Array, "B Hq N D"], k: Float[Array, "B Hkv N D"], granularity: str = "per_token"
) -> QK4:
    """Centre Q and K per head over the sequence and quantize both to symmetric 4 bits.

    .. math:: \\tilde K = K - \\bar k,\\ \\tilde Q = Q - \\bar q,\\ \\hat s_{ij} =
       s^q_i s^k_j (\\hat Q_i \\cdot \\hat K_j) + \\bar q \\cdot \\tilde K_j
       \\approx Q_i \\cdot \\tilde K_j

    Shifting all keys by ``k̄`` adds a per-row constant to the logits, so softmax is unchanged.

    Args:
      q: ``[B, Hq, N, D]`` queries.
      k: ``[B, Hkv, N, D]`` keys.
      granularity: ``"per_token"`` or ``"per_block"`` (16 query rows / 8 keys per scale).

    Returns:
      :class:`QK4`.

    Example::

        >>> import jax.numpy as jnp
        >>> qk4 = quantize_qk_int4(jnp.ones((1, 2, 8, 4)), jnp.ones((1, 1, 8, 4)))
        >>> qk4.q_codes.dtype
        dtype('int8')
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; choose one of {GRANULARITIES}.")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"quantize_qk_int4: Hq={hq} is not a multiple of Hkv={hkv}.")
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    q_mean = jnp.mean(qf, axis=2, keepdims=True)
    k_mean = jnp.mean(kf, axis=2, keepdims=True)
    q_c, k_c = qf - q_mean, kf - k_mean
    q_rows, k_rows = (None, None) if granularity == "per_token" else (16, 8)
    q_codes, q_scale = quantize_int4_symmetric(q_c, q_rows)
    k_codes, k_scale = quantize_int4_symmetric(k_c, k_rows)
    k_rep = jnp.repeat(k_c, hq // hkv, axis=1)
    qmk = jnp.einsum("bhxd,bhnd->bhn", q_mean, k_rep)
    return QK4(q_codes, q_scale, k_codes, k_scale, qmk, k_c.astype(k.dtype))


def integer_qk(q_codes, k_codes):
    """Exact ``Q̂ K̂ᵀ`` as int32 ``[B, Hq, N, N]`` (KV heads repeated for GQA)."""
    groups = q_codes.shape[1] // k_codes.shape[1]
    k_rep = jnp.repeat(k_codes, groups, axis=1)
    return jnp.einsum("bhqd,bhkd->bhqk", q_codes, k_rep, preferred_element_type=jnp.int32)


def estimated_logits(qk4: QK4) -> Float[Array, "B Hq N N"]:
    """``ŝ_ij = (Q̂_i·K̂_j) s^q_i s^k_j + qmk_j`` in fp32 (unscaled logits, no mask)."""
    groups = qk4.q_codes.shape[1] // qk4.k_codes.shape[1]
    k_scale = jnp.repeat(qk4.k_scale, groups, axis=1)
    prod = integer_qk(qk4.q_codes, qk4.k_codes).astype(jnp.float32)
    return prod * qk4.q_scale[..., :, None] * k_scale[..., None, :] + qk4.qmk[..., None, :]


def diagonal_blocks(n: int, cfg: SaleConfig) -> np.ndarray:
    """Index ``d(i)`` of the key block holding query block i's last row (clipped to the end)."""
    n_q, n_k = -(-n // cfg.block_q), -(-n // cfg.block_k)
    rows_end = np.minimum((np.arange(n_q) + 1) * cfg.block_q, n) - 1
    return np.minimum(rows_end // cfg.block_k, n_k - 1)


def middle_end(d, cfg: SaleConfig):
    """Last middle key block for diagonal block ``d`` (middle = ``1 .. middle_end``; may be 0).

    DERIVED from the spec: ``n_loc`` is the smallest count ≥ ``local_window / block_k`` with
    ``d − n_loc ≡ 0 (mod blocks_per_segment)``; works on ints and jnp/np arrays alike.
    """
    bps, local = cfg.blocks_per_segment, cfg.local_blocks
    offset = bps * (-(-local // bps))  # keeps the dividend non-negative (same in kernels)
    n_loc = local + (d - local + offset) % bps
    return np.maximum(d - n_loc, 0) if isinstance(d, np.ndarray) else jnp.maximum(d - n_loc, 0)


def anchor_block_mask(n: int, cfg: SaleConfig) -> np.ndarray:
    """Bool ``[nQ, nK]``: the sink block and the local blocks ``middle_end+1 .. d(i)``."""
    n_k = -(-n // cfg.block_k)
    d = diagonal_blocks(n, cfg)
    mid = middle_end(d, cfg)
    j = np.arange(n_k)[None, :]
    return (j == 0) | ((j > mid[:, None]) & (j <= d[:, None]))


def causal_block_mask(n: int, cfg: SaleConfig) -> np.ndarray:
    """Bool ``[nQ, nK]``: key blocks at or before the diagonal."""
    n_k = -(-n // cfg.block_k)
    return np.arange(n_k)[None, :] <= diagonal_blocks(n, cfg)[:, None]


def causal_density(block_mask, n: int, cfg: SaleConfig):
    """Fraction of the causal ``(query block, key block)`` tiles a block mask computes."""
    causal = jnp.asarray(causal_block_mask(n, cfg))
    per_head = jnp.sum(block_mask & causal, axis=(-2, -1))
    return jnp.mean(per_head / jnp.sum(causal))


def expand_block_mask(block_mask, n: int, cfg: SaleConfig, *, causal: bool = True):
    """Element mask ``[..., N, N]`` from a block mask ``[..., nQ, nK]`` (∩ causal)."""
    rows = np.arange(n) // cfg.block_q
    cols = np.arange(n) // cfg.block_k
    mask = block_mask[..., rows, :][..., :, cols]
    if causal:
        mask = mask & (np.arange(n)[None, :] <= np.arange(n)[:, None])
    return mask


def anchor_stats(
    q: Float[Array, "B Hq N D"],
    k_centred: Float[Array, "B Hkv N D"],
    cfg: SaleConfig,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B Hq N"], Float[Array, "B Hq N"]]:
    """Exact row max ``m_i`` and sum ``l_i = Σ_{j∈R(i)} exp(c (s_ij − m_i))`` over the anchor.

    ``s_ij = Q_i·K̃_j`` (unscaled, fp32). Memory is ``O(N · (local + block_k))``: each query
    block gathers its sink block and a band of keys that covers its local blocks.
    """
    b, hq, n, dim = q.shape
    groups = hq // k_centred.shape[1]
    c = dim ** -0.5 if scale is None else scale
    bq, bk = cfg.block_q, cfg.block_k
    n_q = -(-n // bq)
    band = (cfg.local_blocks + cfg.blocks_per_segment) * bk
    d = jnp.asarray(diagonal_blocks(n, cfg))
    local_start = (jnp.maximum(middle_end(d, cfg) + 1, 1)) * bk  # [nQ] first local key
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, n_q * bq - n), (0, 0)))
    qf = qf.reshape(b, hq, n_q, bq, dim)
    kf = jnp.repeat(k_centred.astype(jnp.float32), groups, axis=1)
    kf = jnp.pad(kf, ((0, 0), (0, 0), (0, band + bk), (0, 0)))
    rows = jnp.arange(n_q)[:, None] * bq + jnp.arange(bq)[None, :]  # [nQ, bq]

    def per_block(qb, start, row):  # qb [B,Hq,bq,D], start scalar, row [bq]
        sink = kf[:, :, :bk]
        local = jax.lax.dynamic_slice_in_dim(kf, start, band, axis=2)
        keys = jnp.concatenate([sink, local], axis=2)
        pos = jnp.concatenate([jnp.arange(bk), start + jnp.arange(band)])
        valid = (pos[None, :] <= row[:, None]) & (pos[None, :] < n)
        valid = valid & ((pos[None, :] < bk) | (pos[None, :] >= jnp.maximum(start, bk)))
        s = jnp.einsum("bhqd,bhkd->bhqk", qb, keys)
        s = jnp.where(valid, s, MASK_VALUE)
        m = jnp.max(s, axis=-1)
        l = jnp.sum(jnp.where(valid, jnp.exp(c * (s - m[..., None])), 0.0), axis=-1)
        return m, l

    m, l = jax.vmap(per_block, in_axes=(2, 0, 0), out_axes=2)(qf, local_start, rows)
    return m.reshape(b, hq, n_q * bq)[..., :n], l.reshape(b, hq, n_q * bq)[..., :n]


def selection_thresholds(m, l, tau: Float[Array, " Hq"], scale: float):
    """Log-domain thresholds ``T_i = m_i + ln(τ_h l_i) / c`` (−∞ for τ=0, +∞ for τ=∞)."""
    c = scale
    tau = jnp.asarray(tau, jnp.float32)[None, :, None]
    return m + jnp.log(tau * l) / c


def sale_select_reference(
    qk4: QK4,
    thresholds: Float[Array, "B Hq N"],
    tau: Float[Array, " Hq"],
    cfg: SaleConfig,
) -> Bool[Array, "B Hq nQ nK"]:
    """Block mask: anchor ∪ {middle blocks with some ``ŝ_ij > T_i``}; dense heads keep all."""
    b, hq, n, _ = qk4.q_codes.shape
    est = estimated_logits(qk4)
    causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
    hit = (est > thresholds[..., None]) & causal
    n_q, n_k = -(-n // cfg.block_q), -(-n // cfg.block_k)
    hit = jnp.pad(hit, ((0, 0), (0, 0), (0, n_q * cfg.block_q - n), (0, n_k * cfg.block_k - n)))
    tiles = hit.reshape(b, hq, n_q, cfg.block_q, n_k, cfg.block_k).any(axis=(3, 5))
    d = diagonal_blocks(n, cfg)
    j = np.arange(n_k)[None, :]
    middle = (j >= 1) & (j <= middle_end(d, cfg)[:, None])
    return combine_selection(tiles & middle, tau, n, cfg)


def combine_selection(middle_hits, tau, n: int, cfg: SaleConfig):
    """``middle_hits ∪ anchor``, and every causal block for dense heads (``τ_h < dense_tau``)."""
    anchor = jnp.asarray(anchor_block_mask(n, cfg))
    causal = jnp.asarray(causal_block_mask(n, cfg))
    dense_head = (jnp.asarray(tau) < cfg.dense_tau)[None, :, None, None]
    return jnp.where(dense_head, causal, middle_hits | anchor)


def block_sparse_attention_reference(
    q: Float[Array, "B Hq N D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    block_mask: Bool[Array, "B Hq nQ nK"],
    cfg: SaleConfig,
    *,
    scale: float | None = None,
) -> Float[Array, "B Hq N D"]:
    """Dense causal softmax attention restricted to the selected ``(block_q × block_k)`` tiles.

    Rows with no visible key return 0. fp32 math, output in ``q.dtype``.
    """
    b, hq, n, dim = q.shape
    groups = hq // k.shape[1]
    scale = dim ** -0.5 if scale is None else scale
    kf = jnp.repeat(k.astype(jnp.float32), groups, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), groups, axis=1)
    logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), kf) * scale
    mask = expand_block_mask(jnp.asarray(block_mask), n, cfg)
    logits = jnp.where(mask, logits, MASK_VALUE)
    probs = jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, vf).astype(q.dtype)


def sale_prefill_reference(q, k, v, tau, cfg: SaleConfig, *, scale=None, return_mask=False):
    """SALE end to end with jnp only (head-major layout); the CPU fallback and the oracle."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qk4 = quantize_qk_int4(q, k, cfg.granularity)
    m, l = anchor_stats(q, qk4.k_centred, cfg, scale=scale)
    thresholds = selection_thresholds(m, l, tau, scale)
    mask = sale_select_reference(qk4, thresholds, tau, cfg)
    out = block_sparse_attention_reference(q, k, v, mask, cfg, scale=scale)
    return (out, mask) if return_mask else out


def calibrate_thresholds(
    attn_inputs_per_layer: Sequence[tuple],
    cfg: SaleConfig,
    *,
    err: float = 0.4,
    tau_init: float = 0.008,
    tau_min: float = 1e-4,
    error_fn: Callable | None = None,
) -> np.ndarray:
    """Per-head thresholds ``[n_layers, Hq]`` by the repo's halving search.

    For every (layer, head): start at ``τ = tau_init``; while the head's error
    ``E = Σ |O_sale − O_dense|`` (summed over its ``[N, D]`` outputs and the batch) is
    ``≥ err · N``, halve τ; once ``τ ≤ tau_min`` set ``τ = 0`` (dense head). Heads are
    independent, so all heads of a layer are searched together (same fixed points).

    Args:
      attn_inputs_per_layer: ``[(q, k, v), ...]`` head-major, one per layer.
      cfg: block geometry.
      err: error budget per token (repo preset ``dynamic_0.4``).
      tau_init, tau_min: start and floor of the search.
      error_fn: ``(layer, (q, k, v), tau [Hq]) -> E [Hq]``; default runs SALE vs dense.

    Returns:
      ``np.ndarray [n_layers, Hq]``.

    Example::

        >>> stub = lambda layer, qkv, tau: 1000.0 * np.asarray(tau)  # E grows with τ
        >>> qkv = (np.zeros((1, 2, 10, 4)),) * 3
        >>> taus = calibrate_thresholds([qkv], SaleConfig(), error_fn=stub)
        >>> taus.astype(float).round(4).tolist()
        [[0.002, 0.002]]
    """
    @jax.jit
    def sale_error(q, k, v, tau):
        dense = jnp.asarray(causal_block_mask(q.shape[2], cfg))
        ref = block_sparse_attention_reference(q, k, v, dense[None, None], cfg)
        out = sale_prefill_reference(q, k, v, tau, cfg)
        diff = jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))
        return jnp.sum(diff, axis=(0, 2, 3))

    def default_error(layer, qkv, tau):
        return np.asarray(sale_error(*qkv, jnp.asarray(tau)))

    error_fn = error_fn or default_error
    result = []
    for layer, qkv in enumerate(attn_inputs_per_layer):
        n, hq = qkv[0].shape[2], qkv[0].shape[1]
        tau = np.full(hq, tau_init, np.float64)
        done = np.zeros(hq, bool)
        for _ in range(int(math.ceil(math.log2(tau_init / tau_min))) + 2):
            errors = np.asarray(error_fn(layer, qkv, tau.astype(np.float32)))
            failing = (~done) & (errors >= err * n)
            done |= ~failing
            tau = np.where(failing, tau / 2, tau)
            floor = failing & (tau <= tau_min)
            tau = np.where(floor, 0.0, tau)
            done |= floor
            if done.all():
                break
        result.append(tau)
    return np.stack(result).astype(np.float32)


__all__ = [
    "GRANULARITIES", "MASK_VALUE", "QK4", "SaleConfig", "anchor_block_mask", "anchor_stats",
    "block_sparse_attention_reference", "calibrate_thresholds", "causal_block_mask",
    "causal_density",
    "combine_selection", "diagonal_blocks", "estimated_logits", "expand_block_mask",
    "integer_qk", "middle_end", "quantize_int4_symmetric", "quantize_qk_int4",
    "sale_prefill_reference", "sale_select_reference", "selection_thresholds",
]
