"""Helpers shared by the scripts (one module; scripts import it as ``scripts._shared``).

Scripts run from the repository root as modules, e.g. ``python -m scripts.reproduce.xkv
--quick``; they use only the public API of ``lowrank_jax``.
"""

from __future__ import annotations

import math


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
