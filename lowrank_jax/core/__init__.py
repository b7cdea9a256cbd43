"""The ground floor: shared maths every other subpackage may use (linear algebra, spectra and
ranks, Kruskal rank, k-means, bit packing, sharding placement, losses); imports only jax, flax,
optax, numpy and ``pallas_kernels``."""

from lowrank_jax.core.losses import (
    PerplexityResult,
    cross_entropy,
    ids_logprob,
    sliding_windows,
    token_logprob,
    token_nll,
    top_logprobs,
    windowed_perplexity,
)
from lowrank_jax.core.step import make_step, scan_steps, scan_train, trainable

__all__ = [
    "PerplexityResult", "cross_entropy", "ids_logprob", "make_step", "scan_steps", "scan_train",
    "sliding_windows", "token_logprob", "token_nll", "top_logprobs", "trainable",
    "windowed_perplexity",
]
