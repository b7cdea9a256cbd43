"""Data: the embedded byte-level corpus, deterministic splits and batches, and data selection
(low-rank residual coresets, :mod:`lowrank_jax.data.selection`)."""

from lowrank_jax.data.corpus import (
    STDLIB_MODULES,
    batch_at,
    corpus_bytes,
    corpus_text,
    corpus_windows,
    eval_batches,
    nats_to_bits,
    train_val_split,
    unigram_entropy_bits,
)
from lowrank_jax.data.selection import (
    Coreset,
    LowRankFit,
    kmeans_sensitivity_coreset,
    lowrank_coreset,
    lowrank_residuals,
    lowrank_residuals_chunked,
    uniform_coreset,
    weighted_mean,
)

__all__ = ["STDLIB_MODULES", "Coreset", "LowRankFit", "batch_at", "corpus_bytes", "corpus_text",
           "corpus_windows", "eval_batches", "kmeans_sensitivity_coreset", "lowrank_coreset",
           "lowrank_residuals", "lowrank_residuals_chunked", "nats_to_bits", "train_val_split",
           "uniform_coreset", "unigram_entropy_bits", "weighted_mean"]
