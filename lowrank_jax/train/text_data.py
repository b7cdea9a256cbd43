"""A user's corpus for ``lowrank-jax pretrain --data``: checked, split, packed, per process.

:func:`open_training_data` runs before anything is compiled and refuses bad data with one line
(:class:`~lowrank_jax.data.DataError`): an empty folder, a file that is not UTF-8, a JSON line
without the text field, a tokenizer larger than the model's vocabulary, less text than one row.
It holds out ``train.val_fraction`` of the documents (at least one), chosen by ``train.seed``,
and builds this process's :class:`~lowrank_jax.data.PackedRows` of every global batch
(:func:`lowrank_jax.train.multihost.process_rows` of the batch sharding). :meth:`next_batch`
gives the step's :class:`~lowrank_jax.data.PackedBatch`, one global ``jax.Array`` per field on
the mesh; :meth:`iterator_at` the iterator positioned after ``step`` batches, for the checkpoint.

The held-out score is the token-weighted mean next-token loss over up to ``train.eval_batches``
batches of packed held-out rows, in nats per token (per byte with the byte tokenizer).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from lowrank_jax.data import DataError, index_documents, unigram_entropy_bits
from lowrank_jax.train import multihost


def _tokenizer_loader(spec: str) -> Callable:
    from lowrank_jax.hub import load_tokenizer

    return functools.partial(load_tokenizer, spec)


@dataclasses.dataclass
class TrainingData:
    """The opened corpus of a run (see the module docstring)."""

    rows: object  # PackedRows of this process's rows
    held_out: object  # PackedBatch (numpy) of held-out rows, a multiple of batch_size
    sharding: object | None  # the batch sharding, None on one device
    batch_size: int
    unit: str  # "byte" or "token"
    entropy_bits: float  # unigram entropy of the held-out tokens, bits per unit
    documents: int
    held_out_documents: int
    vocab_size: int
    _before: dict | None = None

    def next_batch(self):
        """The next step's :class:`~lowrank_jax.data.PackedBatch` (global arrays on a mesh)."""
        from lowrank_jax.data import packed_batch

        self._before = self.rows.get_state()
        batch = packed_batch(next(self.rows))
        if self.sharding is None:
            return batch
        return multihost.global_batch(batch, self.sharding, self.batch_size)

    def iterator_at(self, step: int):
        """The iterator positioned after ``step`` batches (an interrupt may come during a draw
        or between a draw and its update: that draw is undone)."""
        if self._before is not None and self._before["step"] == step:
            self.rows.set_state(self._before)
        if self.rows.step != step:
            raise RuntimeError(f"the data iterator is at batch {self.rows.step}, the model at "
                               f"step {step}.")
        return self.rows

    def evaluate(self, eval_fn, params) -> float:
        """Token-weighted mean of ``eval_fn(params, *batch)`` over the held-out batches."""
        total, count = 0.0, 0
        fields = np.asarray(self.held_out.loss_mask)
        for start in range(0, len(fields), self.batch_size):
            part = [np.asarray(x)[start:start + self.batch_size] for x in self.held_out]
            n = int(part[-1].sum())
            if n:
                total += float(eval_fn(params, *part)) * n
                count += n
        return total / count


def open_training_data(cfg, mesh=None, batch_sharding=None) -> TrainingData:
    """Index, check and split ``cfg.data.path``; this process's packed rows (see the module).

    Args:
        cfg: a :class:`~lowrank_jax.train.config.RunConfig` with ``data.path`` set.
        mesh: the run's mesh (``None``: one device, numpy batches).
        batch_sharding: the batch's sharding on ``mesh`` (default: ``P(("data", "fsdp"))``).

    Raises:
        DataError: one line naming the file, line or setting at fault.
    """
    from lowrank_jax.data import PackedRows, TokenizeText, held_out_rows, packed_batch

    data, train = cfg.data, cfg.train
    documents = index_documents(data.path, text_field=data.text_field)
    if len(documents) < 2:
        raise DataError(f"data={data.path}: 1 document; at least 2 are needed (one is held out "
                        "for validation): add files, or split the text into .jsonl lines.")
    try:
        tokenizer = _tokenizer_loader(data.tokenizer)()
    except (FileNotFoundError, ValueError) as err:
        raise DataError(str(err).splitlines()[0]) from None
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"tokenizer={data.tokenizer} has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={cfg.model.vocab_size}; use "
                        f"`model.vocab_size={tokenizer.vocab_size}`.")
    tokenize = TokenizeText(_tokenizer_loader(data.tokenizer), tokenizer=tokenizer)
    order = np.random.default_rng(train.seed).permutation(len(documents))
    n_val = min(max(1, round(train.val_fraction * len(documents))), len(documents) - 1)
    held, kept = np.sort(order[:n_val]), np.sort(order[n_val:])
    train_docs, val_docs = documents.subset(kept), documents.subset(held)
    row_length = train.seq_len + 1
    tokens = 0
    for i in range(len(train_docs)):
        tokens += len(tokenize(train_docs[i])["tokens"])
        if tokens >= row_length:
            break
    else:
        raise DataError(f"data={data.path}: the {len(train_docs)} training documents hold "
                        f"{tokens} tokens, less than one row of train.seq_len + 1 = {row_length}; "
                        "add text or lower train.seq_len.")
    if mesh is not None and batch_sharding is None:
        from lowrank_jax.train import sharding as shard_lib

        batch_sharding = shard_lib.batch_sharding(mesh)
    rows = (range(train.batch_size) if batch_sharding is None
            else multihost.process_rows(batch_sharding, (train.batch_size, train.seq_len)))
    packed = PackedRows(train_docs, tokenize, batch_size=train.batch_size,
                        row_length=row_length, seed=train.seed, rows=rows)
    val = held_out_rows(val_docs, tokenize, row_length=row_length,
                        max_rows=train.eval_batches * train.batch_size)
    pad = -len(val["tokens"]) % train.batch_size
    val = {k: np.concatenate([v, np.zeros((pad, row_length), v.dtype)]) for k, v in val.items()}
    held_out = packed_batch(val)
    if not held_out.loss_mask.any():
        raise DataError(f"data={data.path}: the {n_val} held-out documents have no two "
                        "consecutive tokens to score; add text.")
    seen = held_out.targets[held_out.loss_mask > 0]
    unit = "byte" if data.tokenizer == "byte" else "token"
    return TrainingData(packed, held_out, batch_sharding, train.batch_size, unit,
                        unigram_entropy_bits(seen, tokenizer.vocab_size), len(train_docs),
                        n_val, tokenizer.vocab_size)


__all__ = ["TrainingData", "open_training_data"]
