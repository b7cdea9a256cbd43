"""FLOP counts of a :class:`~lowrank_jax.models.llama.LlamaConfig`: the one counter.

A decoder's matmul work is its projections (7 per layer, dense ``m·n`` or factorized
``rank·(m + n)`` weights), the attention scores and mixing, and the (tied) LM head:

.. math:: N_\\text{matmul} = L \\sum_\\text{proj} w(m, n) + d V, \\qquad
          F_\\text{fwd}(T) = 2 T N_\\text{matmul} + 4 L H d_h T^2 \\cdot c

with ``c = 1/2`` for causal attention counted as half the score matrix, ``1`` for the full one.
Training counts forward + backward as three forwards (the ``6 N`` rule, Kaplan et al. 2020).
"""

from __future__ import annotations

from lowrank_jax.models.llama import LlamaConfig


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
    """Training FLOPs per token at sequence length ``seq``: ``6·N_matmul + 12·L·d·seq/2``.

    Forward + backward (three forwards) with causal attention scores counted as half.

    Example::

        >>> cfg = LlamaConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=1, n_kv_heads=1,
        ...                   d_ff=8)
        >>> training_flops_per_token(cfg, 2)  # 6·200 + 12·4·2/2
        1248.0
    """
    return 6.0 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.d_model * seq / 2


__all__ = ["forward_flops", "matmul_params", "projection_shapes", "training_flops_per_token"]
