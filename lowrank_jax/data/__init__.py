"""Data: the embedded byte-level corpus, deterministic splits and batches."""

from lowrank_jax.data.corpus import (
    STDLIB_MODULES,
    batch_at,
    corpus_bytes,
    corpus_text,
    eval_batches,
    nats_to_bits,
    train_val_split,
    unigram_entropy_bits,
)

__all__ = ["STDLIB_MODULES", "batch_at", "corpus_bytes", "corpus_text", "eval_batches",
           "nats_to_bits", "train_val_split", "unigram_entropy_bits"]
