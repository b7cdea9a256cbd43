"""Helpers shared by the scripts (one module; scripts import it as ``scripts._shared``).

Scripts run from the repository root as modules, e.g. ``python -m scripts.reproduce.xkv
--quick``; they use only the public API of ``lowrank_jax``.
"""

from __future__ import annotations


def load_model_and_codec(name: str):
    """``(model, encode, decode)`` of anything :func:`lowrank_jax.hub.load_model` reads."""
    from lowrank_jax.hub import load_model

    model, tok = load_model(name)
    return model, (lambda text: tok.encode(text, add_bos=False)), tok.decode
