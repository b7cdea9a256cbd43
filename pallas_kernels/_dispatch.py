"""Helpers shared by the kernels' ``api.py``: picking an implementation, block arithmetic."""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("auto", "pallas", "xla")


def resolve_implementation(implementation: str, interpret: bool) -> str:
    """``"auto"`` → the Pallas kernel on GPU/TPU (or when interpreting), else plain XLA."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}."
        )
    if implementation == "auto":
        return "pallas" if (interpret or jax.default_backend() in ("gpu", "tpu")) else "xla"
    return implementation


def next_pow2(value: int) -> int:
    """The smallest power of two ``>= value`` (Triton block sizes must be powers of two)."""
    out = 1
    while out < value:
        out *= 2
    return out
