"""Public flash attention: ``implementation="auto"|"pallas"|"xla"``, custom VJP.

The attention dispatcher (``lowrank_jax.attention``, ``LlamaConfig(attention="flash")``) registers
it; this package never imports the library.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import _dispatch
from pallas_kernels.flash_attention import kernel as _kernel
from pallas_kernels.flash_attention import kernel_tpu as _kernel_tpu
from pallas_kernels.flash_attention.reference import (
    attention_reference,
    check_attention_shapes,
    check_segment_ids,
    check_window,
    soft_cap,
)

from pallas_kernels._dispatch import IMPLEMENTATIONS  # noqa: E402 (re-export)


@dataclasses.dataclass(frozen=True)
class BlockSizes(_dispatch.TileSizes):
    """Tile sizes of the flash kernels (forward and backward use the same tiles).

    ``block_q`` query rows and ``block_k`` keys per tile, powers of two ≥ 8 (checked once, here;
    see the tiling policy of :mod:`pallas_kernels._dispatch`). The tiles do not change the
    result, so a sequence shorter than a tile fits it (:func:`~pallas_kernels._dispatch.fit_tile`:
    a 40-token prompt uses 64-row tiles, not 128).

    Example::

        >>> BlockSizes(block_q=64, block_k=32).fitted(40, 1000)
        BlockSizes(block_q=64, block_k=32)
        >>> BlockSizes().fitted(40, 20)
        BlockSizes(block_q=64, block_k=32)
    """

    block_q: int = 128
    block_k: int = 128

    def fitted(self, q_len: int, kv_len: int) -> "BlockSizes":
        """These tiles after the one fit rule (:func:`~pallas_kernels._dispatch.fit_tile`)."""
        return BlockSizes(_dispatch.fit_tile(self.block_q, q_len),
                          _dispatch.fit_tile(self.block_k, kv_len))


def resolve_implementation(implementation: str, interpret: Any = None) -> str:
    """``"pallas"`` or ``"xla"``: the one meaning of :mod:`pallas_kernels._dispatch` (``"auto"``:
    the kernel on GPU/TPU or when ``interpret`` is set, the reference elsewhere)."""
    asked = interpret if interpret in (None, True, False) else True  # InterpretParams: kernel
    if implementation == "pallas":  # the platform check below gives the precise message
        return "pallas"
    return _dispatch.resolve(implementation, asked, op="flash_attention")[0]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_head_dim(d: int) -> int:
    """Head dim padded to a power of two ≥ 16 (Triton tile rule); zero columns change nothing."""
    return max(16, 1 << (d - 1).bit_length())


def _forward(q, k, v, segments, static):
    if static.platform == "tpu":
        return _kernel_tpu.flash_forward_tpu(q, k, v, segments, **static.tpu_args())
    return _kernel.flash_forward(q, k, v, segments, **static.kernel_args())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_padded(q, k, v, segments, static):
    return _forward(q, k, v, segments, static)[0]


def _flash_padded_fwd(q, k, v, segments, static):
    out, lse = _forward(q, k, v, segments, static)
    return out, (q, k, v, segments, out, lse)


def _flash_padded_bwd(static, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    if static.platform == "tpu":
        dq, dk, dv = _kernel_tpu.flash_backward_tpu(q, k, v, out, lse, d_out, segments,
                                                    **static.tpu_args())
    else:
        dq, dk, dv = _kernel.flash_backward(q, k, v, out, lse, d_out, segments,
                                            **static.kernel_args())
    return dq, dk, dv, jax.tree.map(lambda _: None, segments)  # integer ids: no cotangent


_flash_padded.defvjp(_flash_padded_fwd, _flash_padded_bwd)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Hashable static kernel arguments (not a pytree, so custom_vjp keeps them static)."""

    scale: float
    block_q: int
    block_k: int
    masks: _kernel.Masks
    platform: str
    interpret: Any

    def kernel_args(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def tpu_args(self) -> dict:
        args = self.kernel_args()
        del args["platform"]
        return args


def flash_attention(
    q: Float[Array, "b tq h d"],
    k: Float[Array, "b tk hk d"],
    v: Float[Array, "b tk hk d"],
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    logit_softcap: float | None = None,
    segment_ids=None,
    block_sizes: BlockSizes | None = None,
    implementation: str = "auto",
    interpret: Any = None,
    platform: str | None = None,
) -> Float[Array, "b tq h d"]:
    """Memory-efficient exact softmax attention (FlashAttention-2) as a Pallas kernel.

    .. math:: O = \\mathrm{softmax}(\\mathrm{cap}(c\\, Q K^\\top) + M) V,

    computed tile by tile with an online softmax (running max ``m``, sum ``l``, fp32), so the
    ``[tq, tk]`` matrix is never stored. Grouped-query attention maps query head ``h`` to KV head
    ``h // (heads / kv_heads)``. Sequences are padded to the tile sizes and the head dim to a
    power of two ≥ 16; padded keys are masked, padded rows and columns are sliced off. The mask
    ``M`` and the soft-cap are those of
    :func:`~pallas_kernels.flash_attention.reference.attention_reference` (causal, sliding
    window, packed-row segments; Gemma 2's ``cap · tanh(x / cap)``); key blocks outside the
    causal range or the window are skipped, not just masked. Differentiable: the VJP runs the
    Pallas dq and dk/dv kernels.

    Backends: GPU lowers to **Triton**, chosen explicitly (``pallas.triton.CompilerParams``):
    the kernel keeps one head's K/V as a full-sequence block and slices it in a ``fori_loop``,
    which Triton turns into pointer loads, while Mosaic GPU would stage the whole block in
    shared memory (227 KB on H100/H200). TPU runs the streaming kernels of
    ``pallas_kernels.flash_attention.kernel_tpu`` (K/V block by block, VMEM scratch
    accumulators; no length limit from VMEM). ``platform="tpu"`` with ``interpret=True`` runs
    those in interpret mode.

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k: ``[batch, kv_len, kv_heads, head_dim]``; ``heads % kv_heads == 0``.
      v: same shape as ``k``.
      causal: query ``i`` sees keys ``j <= i``.
      scale: logit scale ``c`` (default ``head_dim ** -0.5``).
      window: sliding window: query ``i`` sees keys ``j > i - window`` only (None: all).
      logit_softcap: ``cap · tanh(logit / cap)`` on the scaled logits (None: off).
      segment_ids: ``(q_segments [batch, q_len], kv_segments [batch, kv_len])`` integer ids of
        packed documents; a query sees only keys of its own segment.
      block_sizes: tiles; default :meth:`BlockSizes.get_default`.
      implementation: ``"pallas"``, ``"xla"`` (the jnp reference) or ``"auto"`` (pallas on GPU
        and TPU or when ``interpret`` is set, xla elsewhere; see :mod:`pallas_kernels._dispatch`).
      interpret: passed to ``pallas_call``; ``None`` means ``True`` on CPU, ``False`` elsewhere.
      platform: lowering to target: ``"gpu"`` (Triton), ``"tpu"`` (Mosaic) or ``"interpret"``;
        default from the target backend. Set it to export for another platform.

    Returns:
      ``[batch, q_len, heads, head_dim]`` in ``q.dtype``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> q = jax.random.normal(jax.random.key(0), (1, 40, 4, 16))
        >>> k = v = jax.random.normal(jax.random.key(1), (1, 40, 2, 16))
        >>> o = flash_attention(q, k, v, window=8, logit_softcap=30.0, implementation="pallas",
        ...                     interpret=True, block_sizes=BlockSizes(16, 16))
        >>> o.shape
        (1, 40, 4, 16)

    References:
      Dao et al., FlashAttention, https://arxiv.org/abs/2205.14135;
      Dao, FlashAttention-2, https://arxiv.org/abs/2307.08691
    """
    b, tq, tk, h, hk, d = check_attention_shapes(q, k, v)
    if causal and tq > tk:
        raise ValueError(
            f"flash_attention: causal attention with q_len={tq} > kv_len={tk} leaves queries "
            "with no key; pass equal lengths (prefill) or causal=False."
        )
    if window is not None:
        check_window(window)
    if logit_softcap is not None:
        soft_cap(jnp.zeros(()), logit_softcap)  # the reference's check of the cap
        logit_softcap = float(logit_softcap)
    if segment_ids is not None:
        segment_ids = check_segment_ids(segment_ids, b, tq, tk, name="flash_attention")
    scale = d ** -0.5 if scale is None else float(scale)
    if resolve_implementation(implementation, interpret) == "xla":
        return attention_reference(q, k, v, causal=causal, scale=scale, window=window,
                                   logit_softcap=logit_softcap, segment_ids=segment_ids)
    block_sizes = BlockSizes.check("flash_attention", block_sizes)
    platform = platform or _dispatch.backend_platform()
    if platform not in _kernel.PLATFORMS:
        raise ValueError(f"platform={platform!r} is unknown; choose one of {_kernel.PLATFORMS}.")
    if interpret is None:
        interpret = platform == "interpret"
    if platform == "interpret" and not interpret:
        raise ValueError(
            "flash_attention: Pallas kernels run on CPU only in interpret mode; pass "
            "interpret=True or implementation='xla'."
        )
    blocks = block_sizes.fitted(tq, tk)
    tq_pad, tk_pad = _round_up(tq, blocks.block_q), _round_up(tk, blocks.block_k)
    masks = _kernel.Masks(causal=bool(causal), kv_len=tk, window=window,
                          softcap=logit_softcap, segments=segment_ids is not None)
    static = _Static(scale=scale, block_q=blocks.block_q, block_k=blocks.block_k, masks=masks,
                     platform=platform, interpret=interpret)
    return _flash_pallas(q, k, v, segment_ids, static=static, tq_pad=tq_pad, tk_pad=tk_pad,
                         d_pad=padded_head_dim(d))


@functools.partial(jax.jit, static_argnames=("static", "tq_pad", "tk_pad", "d_pad"))
def _flash_pallas(q, k, v, segment_ids, *, static, tq_pad, tk_pad, d_pad):
    tq, d = q.shape[1], q.shape[3]

    def prep(x, t_pad):  # [b, t, h, d] -> zero-padded [b, h, t_pad, d_pad]
        x = jnp.pad(x, ((0, 0), (0, t_pad - x.shape[1]), (0, 0), (0, d_pad - d)))
        return jnp.transpose(x, (0, 2, 1, 3))

    segments = ()
    if segment_ids is not None:  # padded keys are masked by kv_len whatever their id
        q_seg, kv_seg = segment_ids
        q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, tq_pad - tq)))
        kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, tk_pad - kv_seg.shape[1])))
        segments = _kernel.segment_layouts(q_seg, kv_seg, static.block_k)
    out = _flash_padded(prep(q, tq_pad), prep(k, tk_pad), prep(v.astype(q.dtype), tk_pad),
                        segments, static)
    return jnp.transpose(out, (0, 2, 1, 3))[:, :tq, :, :d]


__all__ = ["BlockSizes", "IMPLEMENTATIONS", "flash_attention",
           "padded_head_dim", "resolve_implementation"]
