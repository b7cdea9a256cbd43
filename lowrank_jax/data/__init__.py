"""Data: the embedded byte-level corpus, deterministic splits and batches, a user's corpus on
grain (:mod:`lowrank_jax.data.text_sources`: files to documents; :mod:`lowrank_jax.data.packing`:
tokenized, packed rows per process), and data selection (low-rank residual coresets,
:mod:`lowrank_jax.data.selection`)."""

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
from lowrank_jax.data.text_sources import (
    DataError,
    TextDocuments,
    find_data_files,
    index_documents,
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

_PACKING = ("PackedBatch", "PackedRows", "TokenizeText", "held_out_rows", "packed_batch")


def __getattr__(name: str):
    # grain (and its start-up) is imported only by code that packs a user's corpus
    if name in _PACKING:
        from lowrank_jax.data import packing

        return getattr(packing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DataError", "PackedBatch", "PackedRows", "TextDocuments", "TokenizeText",
           "find_data_files", "held_out_rows", "index_documents", "packed_batch",
           "STDLIB_MODULES", "Coreset", "LowRankFit", "batch_at", "corpus_bytes", "corpus_text",
           "corpus_windows", "eval_batches", "kmeans_sensitivity_coreset", "lowrank_coreset",
           "lowrank_residuals", "lowrank_residuals_chunked", "nats_to_bits", "train_val_split",
           "uniform_coreset", "unigram_entropy_bits", "weighted_mean"]
