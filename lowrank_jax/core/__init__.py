"""The ground floor: shared maths every other subpackage may use (linear algebra, spectra and
ranks, Kruskal rank, k-means, bit packing, sharding placement, losses, the one training step and
the one training loop); imports only jax, flax, optax, numpy, tqdm and ``pallas_kernels``."""

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
from lowrank_jax.core.loop import (
    LoopState,
    NonFiniteLoss,
    iterate_steps,
    progress_bar,
    run_steps,
)
from lowrank_jax.core.step import make_step, scan_steps, scan_train, trainable

__all__ = [
    "LoopState", "NonFiniteLoss", "PerplexityResult", "cross_entropy", "ids_logprob",
    "iterate_steps", "make_step", "progress_bar", "run_steps", "scan_steps", "scan_train",
    "sliding_windows", "token_logprob", "token_nll", "top_logprobs", "trainable",
    "windowed_perplexity",
]
