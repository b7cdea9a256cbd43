"""Video-SVD: subspace-projected attention with layer-shared dual-stream residuals.

Our interpretation of Video-SVD (Wan et al., ICML 2026; no code is public; spec
``video_svd.md``). Per layer and head:

* **offline** (:func:`accumulate_grams`, :func:`fit_bases`): from calibration Q/K/V, Gram matrices
  ``G_q = Σ QᵀQ``, ``G_k``, ``G_v``; the reduced-rank bilinear fit of ``Q Kᵀ`` in whitened
  coordinates (``R_qᵀR_q = G_q + εI``, ``M = R_q R_kᵀ = U Σ Vᵀ``,
  ``F_q = R_q⁻¹ U_r Σ_r^{1/2}``, ``F_k = R_k⁻¹ V_r Σ_r^{1/2}``; ``U_r, V_r`` are the orthogonal
  bases) or a joint PCA basis; ``E_v`` = top eigenvectors of ``G_v``;
* **online** (:func:`video_svd_attention`): ``q̃ = q F_q``, ``k̃ = k F_k``, ``ṽ = v E_v``, the
  subspace logits ``c q̃·k̃`` on far blocks composed with exact logits on the near blocks of a
  spatio-temporal window (the residual stream restoring fine content and position), one softmax,
  latent values mapped back by ``E_vᵀ`` (kernel: :mod:`pallas_kernels.subspace_attention`).

Every interpretive choice is a switch: ``method`` (``"whitened_svd"`` | ``"joint_pca"``), the
rank policy (int or ``"energy:0.99"``), the window (``window_t``, ``window_hw``; ``None`` =
no residual stream), ``v_residual`` (``"latent"`` | ``"far_exact"``) and ``dense_steps``
(our own warm-up knob). Full-rank bases with ``ε = 0`` make the result exact for any window.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from lowrank_jax.core.rank import energy_rank
from pallas_kernels.subspace_attention import BlockSizes, estimate_flops, subspace_attention

SUBSPACE_METHODS = ("whitened_svd", "joint_pca")


class GramStats(NamedTuple):
    """Streaming calibration statistics of one attention layer (sums over tokens)."""

    gram_q: Array  # [heads, d, d] Σ qᵀq (fp32)
    gram_k: Array  # [heads, d, d]
    gram_v: Array  # [heads, d, d]
    count: Array  # [] number of tokens accumulated


class SubspaceBases(NamedTuple):
    """Fitted bases of one layer; ranks are padded with zero columns to the largest head rank."""

    q_basis: Array  # [heads, d, rank]  F_q
    k_basis: Array  # [heads, d, rank]  F_k
    v_basis: Array  # [heads, d, rank_v] E_v (orthonormal columns, zero-padded)
    orth_q: Array  # [heads, d, rank] U_r (whitened coordinates) or P
    orth_k: Array  # [heads, d, rank] V_r or P
    spectrum: Array  # [heads, d] singular values of M (or PCA eigenvalues)
    ranks: Array  # [heads] int, the QK rank used per head
    ranks_v: Array  # [heads] int


def init_grams(heads: int, head_dim: int) -> GramStats:
    """Zero statistics for ``heads`` heads of width ``head_dim``."""
    zeros = jnp.zeros((heads, head_dim, head_dim), jnp.float32)
    return GramStats(zeros, zeros, zeros, jnp.zeros((), jnp.float32))


def accumulate_grams(stats: GramStats, q: Float[ArrayLike, "b n h d"],
                     k: Float[ArrayLike, "b n h d"],
                     v: Float[ArrayLike, "b n h d"]) -> GramStats:
    """Add one calibration batch (post-RoPE q, k and v ``[batch, n, heads, d]``) to ``stats``."""
    if not (q.shape == k.shape == v.shape) or q.shape[2:] != stats.gram_q.shape[:2]:
        raise ValueError(
            f"accumulate_grams: q{q.shape}, k{k.shape}, v{v.shape} must share [batch, n, heads, d] "
            f"with heads, d = {stats.gram_q.shape[:2]} from init_grams."
        )
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    gram = lambda a, b: jnp.einsum("bnhi,bnhj->hij", f32(a), f32(b))  # noqa: E731
    return GramStats(stats.gram_q + gram(q, q), stats.gram_k + gram(k, k),
                     stats.gram_v + gram(v, v),
                     stats.count + q.shape[0] * q.shape[1])


def _rank_for(policy, values: np.ndarray, name: str) -> int:
    """A fixed int rank, or ``"energy:x"`` → :func:`energy_rank` of the singular ``values``."""
    d = values.shape[0]
    if isinstance(policy, (int, np.integer)) and not isinstance(policy, bool):
        if not 1 <= policy <= d:
            raise ValueError(f"fit_bases: {name}={policy} must lie in [1, head_dim={d}].")
        return int(policy)
    if isinstance(policy, str) and policy.startswith("energy:"):
        return int(energy_rank(jnp.asarray(values), float(policy.split(":", 1)[1])))
    raise ValueError(f"fit_bases: {name}={policy!r} must be an int or 'energy:<fraction>', "
                     "e.g. 8 or 'energy:0.99'.")


def _upper_cholesky(gram: np.ndarray, eps: float, name: str) -> np.ndarray:
    try:
        return np.linalg.cholesky(gram + eps * np.eye(gram.shape[0])).T
    except np.linalg.LinAlgError:
        raise ValueError(
            f"fit_bases: the {name} Gram matrix is singular (too few calibration tokens or a "
            "degenerate head); pass eps > 0 (e.g. 1e-6 · trace / d) or use method='joint_pca'."
        ) from None


def fit_bases(stats: GramStats, rank=8, rank_v=None, *, method: str = "whitened_svd",
              eps: float = 0.0) -> SubspaceBases:
    """Fit the checkpoint-adaptive bases of one layer from its Gram statistics (float64, numpy).

    Args:
      stats: :class:`GramStats` from :func:`accumulate_grams`.
      rank: QK rank: an int, or ``"energy:x"`` (per head, the smallest rank holding a fraction
        ``x`` of ``Σσ²`` of ``M``).
      rank_v: V rank, same forms (on the singular values of V); default ``rank`` when it is an
        int, else the same energy policy.
      method: ``"whitened_svd"`` (reduced-rank bilinear fit, the default) or ``"joint_pca"``
        (one orthonormal ``P`` = top eigenvectors of ``G_q/tr G_q + G_k/tr G_k``).
      eps: ridge added to ``G_q, G_k`` before the Cholesky factorisation.

    Returns:
      :class:`SubspaceBases` (fp32); heads with a smaller rank get zero columns.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
        >>> b = fit_bases(accumulate_grams(init_grams(2, 8), x, x, x), rank=8)
        >>> bool(jnp.allclose(b.q_basis[0] @ b.k_basis[0].T, jnp.eye(8), atol=1e-4))
        True
    """
    if method not in SUBSPACE_METHODS:
        raise ValueError(f"fit_bases: method={method!r}; choose one of {SUBSPACE_METHODS}.")
    rank_v = rank if rank_v is None else rank_v
    gq, gk, gv = (np.asarray(g, np.float64) for g in stats[:3])
    heads, d, _ = gq.shape
    out = {key: [] for key in ("fq", "fk", "uq", "uk", "spec", "ev", "r", "rv")}
    for h in range(heads):
        if method == "whitened_svd":
            r_q = _upper_cholesky(gq[h], eps, "query")
            r_k = _upper_cholesky(gk[h], eps, "key")
            u, s, vt = np.linalg.svd(r_q @ r_k.T)
            r = _rank_for(rank, s, "rank")
            root = np.sqrt(s[:r])
            out["fq"].append(np.linalg.solve(r_q, u[:, :r] * root))
            out["fk"].append(np.linalg.solve(r_k, vt[:r].T * root))
            out["uq"].append(u[:, :r])
            out["uk"].append(vt[:r].T)
        else:
            joint = gq[h] / np.trace(gq[h]) + gk[h] / np.trace(gk[h])
            w, p = np.linalg.eigh(joint)
            w, p = w[::-1], p[:, ::-1]
            s = np.sqrt(np.maximum(w, 0.0))
            r = _rank_for(rank, s, "rank")
            out["fq"].append(p[:, :r])
            out["fk"].append(p[:, :r])
            out["uq"].append(p[:, :r])
            out["uk"].append(p[:, :r])
        wv, pv = np.linalg.eigh(gv[h])
        wv, pv = wv[::-1], pv[:, ::-1]
        rv = _rank_for(rank_v, np.sqrt(np.maximum(wv, 0.0)), "rank_v")
        out["ev"].append(pv[:, :rv])
        out["spec"].append(s)
        out["r"].append(r)
        out["rv"].append(rv)

    def stack(mats, width):
        return jnp.asarray(np.stack([np.pad(m, ((0, 0), (0, width - m.shape[1]))) for m in mats]),
                           jnp.float32)

    r_max, rv_max = max(out["r"]), max(out["rv"])
    return SubspaceBases(stack(out["fq"], r_max), stack(out["fk"], r_max), stack(out["ev"], rv_max),
                         stack(out["uq"], r_max), stack(out["uk"], r_max),
                         jnp.asarray(np.stack(out["spec"]), jnp.float32),
                         jnp.asarray(out["r"], jnp.int32), jnp.asarray(out["rv"], jnp.int32))


def project_to_subspaces(q, k, v, bases: SubspaceBases):
    """Online subspace projection ``(q F_q, k F_k, v E_v)`` of ``[batch, n, heads, d]`` inputs."""
    proj = lambda x, basis: jnp.einsum("bnhd,hdr->bnhr", x, basis.astype(x.dtype))  # noqa: E731
    return proj(q, bases.q_basis), proj(k, bases.k_basis), proj(v, bases.v_basis)


def spatiotemporal_block_mask(grid: tuple[int, int, int], block_q: int, block_k: int, *,
                              window_t: int | None = 1, window_hw: int | None = None) -> np.ndarray:
    """Near/far classes ``bool [ceil(n/block_q), ceil(n/block_k)]`` of the residual window.

    Tokens are frame-major ``(t, y, x)`` on ``grid = (frames, height, width)``. A (query block,
    key block) pair is near when some query frame and key frame differ by at most ``window_t``
    and, if ``window_hw`` is set, the blocks' row and column ranges come within ``window_hw``
    (a bounding-box test: exact in time, a superset in space). ``window_t=None`` gives an
    all-far mask (no residual stream).

    Example::

        >>> spatiotemporal_block_mask((3, 2, 2), 4, 4, window_t=0).astype(int).tolist()
        [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    """
    frames, height, width = grid
    for name, value in (("window_t", window_t), ("window_hw", window_hw)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"spatiotemporal_block_mask: {name}={value!r} must be None or an "
                             "int >= 0.")
    n = frames * height * width
    pos = np.arange(n)
    t, y, x = pos // (height * width), (pos // width) % height, pos % width

    def ranges(block):
        starts = np.arange(0, n, block)
        lo = lambda a: np.minimum.reduceat(a, starts)  # noqa: E731
        hi = lambda a: np.maximum.reduceat(a, starts)  # noqa: E731
        return [(lo(a), hi(a)) for a in (t, y, x)]

    def close(qr, kr, w):
        return (qr[0][:, None] - w <= kr[1][None, :]) & (kr[0][None, :] <= qr[1][:, None] + w)

    rq, rk = ranges(block_q), ranges(block_k)
    if window_t is None:
        return np.zeros((len(rq[0][0]), len(rk[0][0])), bool)
    near = close(rq[0], rk[0], window_t)
    if window_hw is not None:
        near &= close(rq[1], rk[1], window_hw) & close(rq[2], rk[2], window_hw)
    return near


@dataclasses.dataclass(frozen=True)
class VideoSVDConfig:
    """Layer-shared Video-SVD settings (the residual window and the streams' switches)."""

    block_q: int = 16
    block_k: int = 16
    window_t: int | None = 1  # None: no residual stream (all far)
    window_hw: int | None = None
    v_residual: str = "latent"  # or "far_exact"
    dense_steps: int = 0  # our own warm-up knob: the first sampling steps use dense attention
    implementation: str = "auto"

    def block_sizes(self) -> BlockSizes:
        return BlockSizes(self.block_q, self.block_k)


def video_svd_attention(q: Float[ArrayLike, "b n h d"], k: Float[ArrayLike, "b n h d"],
                        v: Float[ArrayLike, "b n h d"], bases: SubspaceBases,
                        near_mask: Bool[ArrayLike, "nq nk"],
                        config: VideoSVDConfig = VideoSVDConfig(),
                        *, interpret=None) -> Float[Array, "b n h d"]:
    """Inference attention: project onto the bases, compose with the exact near stream.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
        >>> b = fit_bases(accumulate_grams(init_grams(2, 8), x, x, x), rank=8)
        >>> mask = spatiotemporal_block_mask((2, 4, 4), 16, 16, window_t=None)
        >>> dense = jax.nn.dot_product_attention(x, x, x)
        >>> bool(jnp.allclose(video_svd_attention(x, x, x, b, mask), dense, atol=1e-4))
        True
    """
    q_lat, k_lat, v_lat = project_to_subspaces(q, k, v, bases)
    return subspace_attention(q, k, v, q_lat, k_lat, v_lat, bases.v_basis, jnp.asarray(near_mask),
                              block_sizes=config.block_sizes(), v_residual=config.v_residual,
                              implementation=config.implementation, interpret=interpret)


def attention_flops(n: int, head_dim: int, rank: int, rank_v: int, near_mask, block_q: int,
                    block_k: int, *, v_residual: str = "latent") -> dict:
    """Matmul FLOPs per head: dense, the dual-stream attention and the online projection."""
    near_mask = np.asarray(near_mask, bool)
    rows = np.minimum(block_q, n - block_q * np.arange(near_mask.shape[0]))
    cols = np.minimum(block_k, n - block_k * np.arange(near_mask.shape[1]))
    near_pairs = int(np.sum(near_mask * rows[:, None] * cols[None, :]))
    latent = v_residual == "latent"
    cost = estimate_flops(n, head_dim, rank, rank_v, near_pairs, latent_values=latent)
    projection = 2 * n * head_dim * (2 * rank + (rank_v if latent else 0))
    total = cost["subspace"] + projection
    return {"dense": cost["dense"], "attention": cost["subspace"], "projection": projection,
            "near_fraction": near_pairs / (n * n), "saved": 1.0 - total / cost["dense"],
            "ratio": cost["dense"] / total}


def qk_singular_values(q: Float[Array, "n d"], k: Float[Array, "n d"]) -> Float[Array, " d"]:
    """Singular values of the pre-softmax ``Q Kᵀ`` of one head, via the ``d × d`` whitened core.

    ``Q = A R_q`` and ``K = B R_k`` (QR) give ``Q Kᵀ = A (R_q R_kᵀ) Bᵀ``, so the spectrum is that
    of ``R_q R_kᵀ``: ``O(n d²)`` instead of an ``n × n`` SVD.
    """
    r_q = jnp.linalg.qr(q.astype(jnp.float32), mode="r")
    r_k = jnp.linalg.qr(k.astype(jnp.float32), mode="r")
    return jnp.linalg.svd(r_q @ r_k.T, compute_uv=False)


__all__ = ["SUBSPACE_METHODS", "GramStats", "SubspaceBases", "VideoSVDConfig", "accumulate_grams",
           "attention_flops", "fit_bases", "init_grams", "project_to_subspaces",
           "qk_singular_values", "spatiotemporal_block_mask", "video_svd_attention"]
