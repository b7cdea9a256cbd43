"""Documents → tokens → packed fixed-length rows on grain, one disjoint set of rows per process.

The pipeline of row ``r`` of the global batch (``B`` rows) is a grain dataset::

    MapDataset.source(documents).shuffle(seed).repeat()[r::B]   # its documents, every epoch
        .map(TokenizeText(...))                                 # ids (+ EOS), picklable
        .to_iter_dataset()
    ConcatThenSplitIterDataset(length = seq_len + 1)            # packed rows

so row ``r`` of step ``t`` depends only on ``(documents, seed, B, r, t)``, never on how many
processes there are: a process builds the rows of its devices only (:class:`PackedRows` with
``rows=range(lo, hi)``), and 2 processes give the global batch of 1. Packing writes the
``segment_ids`` (1, 2, ... per document piece of a row, 0 for padding) and per-document
``positions`` (restarting at 0); a document longer than what is left of a row continues, as a
new segment, in the row's next one.

A row of ``seq_len + 1`` tokens gives ``seq_len`` inputs and next-token targets
(:func:`packed_batch`); the target of a position is counted only when it belongs to the same
document piece (``loss_mask``): the first token of the next document is not predicted from the
end of the previous one (the end of a document is predicted: the tokenizer's EOS is appended).

The iterator's state (:meth:`PackedRows.get_state`, JSON) is one grain state per row; it goes
into the run's orbax checkpoint with ``grain.checkpoint.CheckpointSave`` (one file per process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grain
import numpy as np

STATE_VERSION = 1


class TokenizeText:
    """The picklable tokenizing transform: text → ``{"tokens": int32 ids (+ EOS)}``.

    ``load`` (a picklable callable, e.g. ``functools.partial(hub.load_tokenizer, "smollm2")``)
    builds the tokenizer on first use; pickling drops the built tokenizer (as MaxText does), so a
    grain worker process rebuilds its own.

    Example::

        >>> import pickle
        >>> from lowrank_jax.models.tokenizer import ByteTokenizer
        >>> tokenize = TokenizeText(ByteTokenizer)
        >>> tokenize("hi")["tokens"].tolist()
        [104, 105]
        >>> pickle.loads(pickle.dumps(tokenize))("hi")["tokens"].tolist()
        [104, 105]
    """

    def __init__(self, load: Callable[[], Any], *, append_eos: bool = True, tokenizer=None):
        self.load, self.append_eos = load, append_eos
        self._tokenizer = tokenizer  # an already built one (this process's), else built lazily

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.load()
        return self._tokenizer

    def __getstate__(self):
        return {"load": self.load, "append_eos": self.append_eos, "_tokenizer": None}

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        tokenizer = self.tokenizer
        ids = tokenizer.encode(text)
        if self.append_eos and tokenizer.eos_id is not None:
            ids = list(ids) + [tokenizer.eos_id]
        return {"tokens": np.asarray(ids, np.int32)}


def _row_stream(documents, tokenize, *, row: int, rows_total: int, row_length: int, seed: int,
                repeat: bool = True, shuffle: bool = True):
    ds = grain.MapDataset.source(documents)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat(None)
    # read in this thread: a row needs a few documents per step, and a thread pool per row
    # (grain's default: 16 threads, 500 elements ahead) costs more than it saves
    ds = ds[row::rows_total].map(tokenize).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return iter(grain.experimental.ConcatThenSplitIterDataset(
        ds, length_struct={"tokens": row_length}))


def _stack(elements: list[dict]) -> dict[str, np.ndarray]:
    return {"tokens": np.stack([e["tokens"] for e in elements]).astype(np.int32),
            "segment_ids": np.stack([e["tokens_segment_ids"] for e in elements]).astype(np.int32),
            "positions": np.stack([e["tokens_positions"] for e in elements]).astype(np.int32)}


class DataStateMismatch(ValueError):
    """A saved iterator state that does not fit this iterator (other data, batch, seed or process
    layout): the user's mistake, not a damaged checkpoint."""


class PackedRows(grain.DatasetIterator):
    """Rows ``rows`` of every global batch of packed documents (see the module docstring).

    ``next(it)`` is ``{"tokens", "segment_ids", "positions"}``, each ``[len(rows), row_length]``
    int32. ``get_state()`` / ``set_state()`` save and restore the position (JSON); a state of
    other rows, another batch size, row length, seed or corpus is refused with a clear error.

    Example::

        >>> from lowrank_jax.models.tokenizer import ByteTokenizer
        >>> it = PackedRows(["abc", "de", "fghij"], TokenizeText(ByteTokenizer), batch_size=2,
        ...                 row_length=4, seed=0, rows=range(0, 2))
        >>> next(it)["tokens"].shape
        (2, 4)
    """

    def __init__(self, documents, tokenize: Callable, *, batch_size: int, row_length: int,
                 seed: int, rows: range | None = None):
        super().__init__()
        rows = range(batch_size) if rows is None else rows
        if not (0 <= rows.start < rows.stop <= batch_size and rows.step == 1):
            raise ValueError(f"rows={rows} must be a non-empty contiguous part of "
                             f"range({batch_size}).")
        if row_length < 2:
            raise ValueError(f"row_length={row_length} must be >= 2 (inputs and targets).")
        self.documents, self.tokenize = documents, tokenize
        self.batch_size, self.row_length, self.seed, self.rows = (
            batch_size, row_length, seed, rows)
        self._streams = [_row_stream(documents, tokenize, row=r, rows_total=batch_size,
                                     row_length=row_length, seed=seed) for r in rows]
        self.step = 0

    def __next__(self) -> dict[str, np.ndarray]:
        batch = _stack([next(s) for s in self._streams])
        self.step += 1
        return batch

    def _meta(self) -> dict:
        return {"version": STATE_VERSION, "rows": [self.rows.start, self.rows.stop],
                "batch_size": self.batch_size, "row_length": self.row_length,
                "seed": self.seed, "documents": len(self.documents)}

    def get_state(self) -> dict:
        return {**self._meta(), "step": self.step,
                "streams": [s.get_state() for s in self._streams]}

    def set_state(self, state: dict) -> None:
        want = self._meta()
        names = {"rows": "this process's rows of the batch (the mesh or process count changed)",
                 "batch_size": "train.batch_size", "row_length": "train.seq_len + 1",
                 "seed": "train.seed", "documents": "the number of documents under `data`",
                 "version": "the state format"}
        for key, value in want.items():
            if state.get(key) != value:
                raise DataStateMismatch(
                    f"`resume`: the data iterator in the checkpoint was saved with {key}="
                    f"{state.get(key)} ({names[key]}), this run has {value}; resume with the "
                    "same data, batch size, sequence length, seed and process layout, or start "
                    "a new run.")
        for stream, saved in zip(self._streams, state["streams"]):
            # grain 0.2.18 compares the slices with a tuple sentinel: after JSON (lists) every
            # state would read as "has a remainder" and restore the wrong position
            saved = {**saved, "remainder_slices": {
                k: tuple(v) for k, v in saved["remainder_slices"].items()}}
            stream.set_state(saved)
        self.step = int(state["step"])

    def __repr__(self) -> str:
        return (f"PackedRows(rows {self.rows.start}..{self.rows.stop - 1} of {self.batch_size}, "
                f"row_length={self.row_length}, step={self.step})")


def held_out_rows(documents, tokenize: Callable, *, row_length: int, max_rows: int
                  ) -> dict[str, np.ndarray]:
    """Up to ``max_rows`` packed rows of ``documents`` in order, one pass (the held-out set).

    The last row may be padded (segment id 0).

    Example::

        >>> from lowrank_jax.models.tokenizer import ByteTokenizer
        >>> rows = held_out_rows(["abc", "de"], TokenizeText(ByteTokenizer), row_length=4,
        ...                      max_rows=8)
        >>> rows["segment_ids"].tolist()
        [[1, 1, 1, 2], [1, 0, 0, 0]]
    """
    stream = _row_stream(documents, tokenize, row=0, rows_total=1, row_length=row_length,
                         seed=0, repeat=False, shuffle=False)
    elements = []
    for element in stream:
        elements.append(element)
        if len(elements) == max_rows:
            break
    if not elements:
        raise ValueError("held_out_rows: the documents hold no tokens.")
    return _stack(elements)


class PackedBatch(NamedTuple):
    """One step's packed batch, every field ``[batch, seq_len]``: ``inputs``, next-token
    ``targets``, the inputs' ``segment_ids`` and ``positions``, and the ``loss_mask`` (1 where
    the target lies in the input's document piece)."""

    inputs: Any
    targets: Any
    segment_ids: Any
    positions: Any
    loss_mask: Any


def packed_batch(rows: dict[str, np.ndarray]) -> PackedBatch:
    """Rows of ``seq_len + 1`` packed tokens (:class:`PackedRows`) as a :class:`PackedBatch`.

    Example::

        >>> rows = {"tokens": np.array([[5, 6, 7, 8]]), "segment_ids": np.array([[1, 1, 2, 2]]),
        ...         "positions": np.array([[0, 1, 0, 1]])}
        >>> packed_batch(rows).loss_mask.tolist()
        [[1, 0, 1]]
    """
    tokens, seg, pos = rows["tokens"], rows["segment_ids"], rows["positions"]
    mask = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] > 0)
    return PackedBatch(tokens[:, :-1], tokens[:, 1:], seg[:, :-1], pos[:, :-1],
                       mask.astype(np.int32))


__all__ = ["DataStateMismatch", "PackedBatch", "PackedRows", "TokenizeText", "held_out_rows",
           "packed_batch"]
