"""Re-export of the package's one next-token cross-entropy (:mod:`lowrank_jax.core.losses`)."""

from __future__ import annotations

from lowrank_jax.core.losses import cross_entropy, token_nll

__all__ = ["cross_entropy", "token_nll"]
