"""FLOP counts of a :class:`~lowrank_jax.models.llama.LlamaConfig` and the chips' peaks: the one
counter behind ``plan``, ``compile`` and the MFU of ``pretrain``.

A decoder's matmul work is its projections (7 per layer, dense ``m·n`` or factorized
``rank·(m + n)`` weights), the attention scores and mixing, and the (tied) LM head:

.. math:: N_\\text{matmul} = L \\sum_\\text{proj} w(m, n) + d V, \\qquad
          F_\\text{fwd}(T) = 2 T N_\\text{matmul} + 4 L H d_h T^2 \\cdot c

with ``c = 1/2`` for causal attention counted as half the score matrix, ``1`` for the full one.
Training counts forward + backward as three forwards (the ``6 N`` rule, Kaplan et al. 2020).
These are *model* FLOPs: rematerialisation recomputes a forward, which costs time but is not
counted (MFU, as MaxText and levanter define it, divides model FLOPs by the chip's peak).

:data:`CHIPS` is the one table of accelerators: bf16 dense peak and HBM per chip;
:func:`chip_for_device_kind` names the chip of a ``jax.Device`` and :func:`mfu` divides.
"""

from __future__ import annotations

import dataclasses

from lowrank_jax.models.llama import LlamaConfig

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One accelerator: its bf16 dense peak (FLOP/s) and HBM (bytes) per chip."""

    name: str
    peak_flops: float
    hbm_bytes: int
    device_kinds: tuple[str, ...]  # ``jax.devices()[0].device_kind`` spellings


#: bf16 dense peaks and HBM per chip (vendor data sheets; TPU "chips", not cores).
CHIPS = {
    "v4": ChipSpec("TPU v4", 275e12, 32 * GIB, ("TPU v4",)),
    "v5e": ChipSpec("TPU v5e", 197e12, 16 * GIB, ("TPU v5 lite", "TPU v5e")),
    "v5p": ChipSpec("TPU v5p", 459e12, 95 * GIB, ("TPU v5", "TPU v5p")),
    "v6e": ChipSpec("TPU v6e", 918e12, 32 * GIB, ("TPU v6 lite", "TPU v6e")),
    # GPU memory as the driver reports it (nvidia-smi: 81559 MiB and 143771 MiB)
    "h100": ChipSpec("NVIDIA H100 SXM", 989e12, 81559 * 2**20, ("NVIDIA H100 80GB HBM3",)),
    "h200": ChipSpec("NVIDIA H200", 989e12, 143771 * 2**20, ("NVIDIA H200",)),
}


def chip_for_device_kind(device_kind: str) -> str | None:
    """The :data:`CHIPS` key of a ``jax.Device.device_kind``, or ``None`` (a CPU, an unknown chip).

    Example::

        >>> chip_for_device_kind("TPU v5 lite"), chip_for_device_kind("NVIDIA H200")
        ('v5e', 'h200')
        >>> chip_for_device_kind("cpu") is None
        True
    """
    for key, spec in CHIPS.items():
        if device_kind in spec.device_kinds:
            return key
    lowered = device_kind.lower()
    for key in ("h100", "h200"):
        if key in lowered:
            return key
    return None


def peak_flops(device_kind: str, peak_tflops: float | None = None) -> float | None:
    """The bf16 peak (FLOP/s) MFU is measured against: ``peak_tflops`` when given, else the
    chip of ``device_kind`` in :data:`CHIPS`, else ``None`` (a CPU: MFU is then not reported).

    Example::

        >>> peak_flops("TPU v6 lite"), peak_flops("cpu"), peak_flops("cpu", 1.5)
        (918000000000000.0, None, 1500000000000.0)
    """
    if peak_tflops:
        return float(peak_tflops) * 1e12
    chip = chip_for_device_kind(device_kind)
    return None if chip is None else CHIPS[chip].peak_flops


def mfu(flops_per_token: float, tokens_per_s_per_device: float,
        peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the chip's peak.

    ``None`` when the peak is unknown (a CPU without ``train.peak_tflops``).

    Example::

        >>> mfu(6e9, 10_000.0, 197e12)  # 6 GFLOP/token at 10k tokens/s on a v5e
        0.30456852791878175
    """
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_s_per_device / peak_flops


def projection_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """``(in, out)`` of the 7 projections of one decoder layer (q, k, v, o, gate, up, down)."""
    d, f = cfg.d_model, cfg.d_ff
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def matmul_params(cfg: LlamaConfig) -> int:
    """Weights that take part in a matmul per token: projections of every layer + LM head.

    A ``projection="factorized"`` config counts ``rank·(in + out)`` per projection.

    Example::

        >>> cfg = LlamaConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=1, n_kv_heads=1,
        ...                   d_ff=8)
        >>> matmul_params(cfg)  # 4 · 16 (q k v o) + 3 · 32 (MLP) + 40 (head)
        200
    """
    factorized = cfg.projection == "factorized"
    per_layer = sum(cfg.rank_for(m, n) * (m + n) if factorized else m * n
                    for m, n in projection_shapes(cfg))
    return cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size


def forward_flops(cfg: LlamaConfig, tokens: int, *, causal: bool = False) -> float:
    """Matmul FLOPs of one forward pass over a sequence of ``tokens`` tokens.

    Args:
        cfg: the model config.
        tokens: sequence length ``T``.
        causal: count the attention scores of the causal half only (default: the full
            ``T × T`` products ``QKᵀ`` and ``PV``, what a dense kernel computes).

    Example::

        >>> cfg = LlamaConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=1, n_kv_heads=1,
        ...                   d_ff=8)
        >>> forward_flops(cfg, 2)  # 2·2·200 + 4·1·4·2²
        864.0
    """
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * tokens * tokens
    return float(2 * tokens * matmul_params(cfg) + (attention / 2 if causal else attention))


def training_flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """Training FLOPs per token at sequence length ``seq``: ``6·N_matmul + 12·L·H·d_h·seq/2``.

    Forward + backward (three forwards) with causal attention scores counted as half
    (``H·d_h`` is the query width, ``d_model`` unless ``head_dim`` is set).

    Example::

        >>> cfg = LlamaConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=1, n_kv_heads=1,
        ...                   d_ff=8)
        >>> training_flops_per_token(cfg, 2)  # 6·200 + 12·4·2/2
        1248.0
    """
    width = cfg.n_heads * cfg.head_dim
    return 6.0 * matmul_params(cfg) + 12 * cfg.n_layers * width * seq / 2


__all__ = ["CHIPS", "ChipSpec", "chip_for_device_kind", "forward_flops", "matmul_params", "mfu",
           "peak_flops", "projection_shapes", "training_flops_per_token"]
