"""Helpers shared by the scripts (one module; scripts import it as ``scripts._shared``).

Scripts run from the repository root as modules, e.g. ``python -m scripts.reproduce.xkv
--quick``; they use only the public API of ``lowrank_jax``.
"""

from __future__ import annotations

import math

import numpy as np

from lowrank_jax.data import corpus_text
from lowrank_jax.models import LlamaConfig


def flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """``6·N_matmul + 12·L·d·seq/2`` (forward+backward; causal attention scores ≈ half)."""
    d, f = cfg.d_model, cfg.d_ff
    shapes = [(d, cfg.n_heads * cfg.head_dim), (d, cfg.n_kv_heads * cfg.head_dim),
              (d, cfg.n_kv_heads * cfg.head_dim), (cfg.n_heads * cfg.head_dim, d),
              (d, f), (d, f), (f, d)]
    per_layer = 0
    for m, n in shapes:
        per_layer += cfg.rank_for(m, n) * (m + n) if cfg.projection == "factorized" else m * n
    n_matmul = cfg.n_layers * per_layer + d * cfg.vocab_size  # + tied LM head
    attention = 12 * cfg.n_layers * d * seq / 2
    return 6.0 * n_matmul + attention


def lr_shape(step: int, total: int, warmup_frac: float) -> float:
    """Linear warmup over ``warmup_frac`` of the steps, then cosine decay to 10%."""
    warmup = max(1, int(round(warmup_frac * total)))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def load_model_and_codec(name: str):
    """``(model, encode, decode)`` of anything :func:`lowrank_jax.hub.load_model` reads."""
    from lowrank_jax.hub import load_model

    model, tok = load_model(name)
    return model, (lambda text: tok.encode(text, add_bos=False)), tok.decode


def corpus_windows(encode, n: int, length: int) -> list[np.ndarray]:
    """``n`` windows of ``length`` tokens from evenly spaced places of the corpus."""
    text = corpus_text()
    out = []
    for i in range(n):
        start = (i * len(text)) // n
        chars = 6 * length
        while True:
            ids = encode(text[start: start + chars])
            if len(ids) >= length or start + chars >= len(text):
                break
            chars *= 2
        if len(ids) < length:
            raise ValueError(f"corpus too short for window {i} of {length} tokens.")
        out.append(np.asarray(ids[:length], np.int32))
    return out
