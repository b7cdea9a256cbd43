"""Named toy models: one preset per name, used by the CLI (``--model tiny``), scripts and tests.

Example::

    >>> preset_config("tiny").n_layers
    2
"""

from __future__ import annotations

from lowrank_jax.models.llama import Llama, LlamaConfig

#: Named model configurations (``--model NAME``): keyword arguments of ``LlamaConfig``.
PRESETS: dict[str, dict] = {
    # the byte-level smoke-test model of `finetune --model tiny`, `analyze --model tiny` and the
    # BaLoRA fine-tuning reproduction
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                 max_seq_len=256),
    # 8 layers and a 4k context: enough layers for cross-layer (xKV) groups, for plumbing runs
    # of the xKV reproduction without the real checkpoint
    "tiny-deep": dict(vocab_size=256, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2,
                      d_ff=128, max_seq_len=4096),
}


def preset_config(name: str, **overrides) -> LlamaConfig:
    """The :class:`LlamaConfig` of preset ``name`` (keyword ``overrides`` replace fields)."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; presets: {', '.join(PRESETS)}.")
    return LlamaConfig(**{**PRESETS[name], **overrides})


def preset_model(name: str, *, seed: int = 0, **overrides) -> Llama:
    """A randomly initialised :class:`Llama` of preset ``name`` (``nnx.Rngs(seed)``)."""
    from flax import nnx

    return Llama(preset_config(name, **overrides), rngs=nnx.Rngs(seed))


__all__ = ["PRESETS", "preset_config", "preset_model"]
