"""The grain pipeline of ``pretrain --data``: sources, packing, per-process rows, iterator state,
and packed attention / loss through the one model core."""

from __future__ import annotations

import json
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.data import (
    PackedRows,
    TokenizeText,
    find_data_files,
    held_out_rows,
    index_documents,
    packed_batch,
)
from lowrank_jax.models import Llama, LlamaConfig, PackedKV
from lowrank_jax.models.tokenizer import ByteTokenizer
from lowrank_jax.train.losses import lm_loss

DOCS = ["alpha beta", "gamma", "delta epsilon zeta", "eta", "theta iota kappa lambda", "mu nu",
        "xi", "omicron pi rho"]


def _rows(docs, batch_size, rows=None, row_length=7, seed=3):
    return PackedRows(docs, TokenizeText(ByteTokenizer), batch_size=batch_size,
                      row_length=row_length, seed=seed, rows=rows)


def test_packing_concatenates_documents_with_segment_ids_and_positions():
    rows = held_out_rows(["abc", "de", "fghij"], TokenizeText(ByteTokenizer), row_length=4,
                         max_rows=10)
    assert rows["tokens"].tolist() == [[97, 98, 99, 100], [101, 102, 103, 104],
                                       [105, 106, 0, 0]]
    # a document cut at the end of a row continues in the next one as a new segment
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 2, 2, 2], [1, 1, 0, 0]]
    assert rows["positions"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 0, 0]]
    batch = packed_batch(rows)
    # targets inside a document piece count; across a boundary and on padding they do not
    assert batch.loss_mask.tolist() == [[1, 1, 0], [0, 1, 1], [1, 0, 0]]
    assert batch.inputs.tolist()[0] == [97, 98, 99] and batch.targets.tolist()[0] == [98, 99, 100]


def test_every_token_of_every_document_is_packed_once_per_epoch():
    docs = [f"document {i} " + "x" * i for i in range(12)]
    it = _rows(docs, batch_size=3, row_length=16)
    streams = [b"", b"", b""]  # a row's documents continue in the same row of the next step
    for _ in range(12):
        batch = next(it)
        for r in range(3):
            keep = batch["segment_ids"][r] > 0
            streams[r] += batch["tokens"][r][keep].astype(np.uint8).tobytes()
    for doc in docs:  # 12 steps x 3 rows x 16 bytes cover the 12 documents (<= 256 bytes)
        assert sum(s.count(doc.encode()) for s in streams) >= 1, doc
    # each row reads its own documents: row r holds documents r, r + 3, ... of each epoch
    firsts = [s[:12] for s in streams]  # "document N x"
    assert len(set(firsts)) == 3


def test_process_rows_are_disjoint_and_make_the_one_process_batch():
    whole = _rows(DOCS, batch_size=4)
    parts = [_rows(DOCS, batch_size=4, rows=range(0, 1)), _rows(DOCS, batch_size=4,
                                                                rows=range(1, 4))]
    for _ in range(6):  # past the first epoch of every row
        want = next(whole)
        got = [next(p) for p in parts]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])


def test_iterator_state_restores_mid_epoch_and_is_json():
    it = _rows(DOCS, batch_size=2)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(4)]
    fresh = _rows(DOCS, batch_size=2)
    fresh.set_state(state)
    assert fresh.step == 3
    for expected in want:
        got = next(fresh)
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])


def test_iterator_state_of_another_layout_is_refused():
    state = _rows(DOCS, batch_size=4, rows=range(0, 2)).get_state()
    with pytest.raises(ValueError, match=r"saved with rows=\[0, 2\].*process layout"):
        _rows(DOCS, batch_size=4, rows=range(0, 4)).set_state(state)
    with pytest.raises(ValueError, match="batch_size=4 .train.batch_size"):
        _rows(DOCS, batch_size=2, rows=range(0, 2)).set_state(state)


def test_tokenizer_transform_pickles_without_its_tokenizer():
    loads = []

    tokenize = TokenizeText(ByteTokenizer)
    assert tokenize("ab")["tokens"].tolist() == [97, 98]
    assert tokenize._tokenizer is not None
    copy = pickle.loads(pickle.dumps(tokenize))
    assert copy._tokenizer is None  # dropped in __getstate__, rebuilt on first use
    assert copy("ab")["tokens"].tolist() == [97, 98]
    del loads


class _EosTokenizer(ByteTokenizer):
    eos_id = 3


def test_eos_is_appended_to_every_document():
    assert TokenizeText(_EosTokenizer)("ab")["tokens"].tolist() == [97, 98, 3]
    assert TokenizeText(_EosTokenizer, append_eos=False)("ab")["tokens"].tolist() == [97, 98]


def test_sources_txt_jsonl_arrayrecord_and_globs(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    (tmp_path / "a.txt").write_text("one whole file\n")
    (tmp_path / "blank.txt").write_text("  \n")  # empty documents are left out
    (tmp_path / "b.jsonl").write_text('{"body": "line one"}\n\n{"body": "line two"}\n')
    sub = tmp_path / "sub"
    sub.mkdir()
    writer = ArrayRecordWriter(str(sub / "c.arrayrecord"), "group_size:1")
    for text in ("record zero", "record one"):
        writer.write(text.encode())
    writer.close()
    (tmp_path / "notes.md").write_text("not data")
    docs = index_documents(tmp_path, text_field="body")
    assert sorted(docs[i] for i in range(len(docs))) == sorted(
        ["one whole file\n", "line one", "line two", "record zero", "record one"])
    assert [p.name for p in find_data_files(str(tmp_path / "*.jsonl"))] == ["b.jsonl"]
    # the source pickles as its index (grain workers reopen the files)
    copy = pickle.loads(pickle.dumps(docs))
    assert [copy[i] for i in range(len(copy))] == [docs[i] for i in range(len(docs))]


def _model():
    cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                      projection="factorized", rank_ratio=0.5)
    return Llama(cfg, rngs=nnx.Rngs(0))


def test_a_packed_row_has_the_logits_of_each_document_alone():
    model = _model()
    docs = [np.array([5, 9, 2, 7]), np.array([11, 3, 8]), np.array([1, 4])]
    row = jnp.asarray(np.concatenate(docs + [np.zeros(2, int)]))[None]  # 2 padding tokens
    seg = jnp.asarray([[1] * 4 + [2] * 3 + [3] * 2 + [0] * 2])
    pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1]])
    packed, cache = model(row, pos, cache=PackedKV(seg))
    assert cache is None
    alone_logits = nnx.jit(lambda m, ids: m(ids)[0])  # one compiled program per length
    start = 0
    for doc in docs:
        alone = alone_logits(model, jnp.asarray(doc)[None])
        np.testing.assert_allclose(packed[0, start:start + len(doc)], alone[0], atol=2e-5)
        start += len(doc)
    # without the segment ids the second document sees the first: the logits differ
    mixed, _ = model(row, pos)
    assert float(jnp.abs(mixed[0, 4:7] - packed[0, 4:7]).max()) > 1e-3


def test_the_packed_loss_is_the_token_weighted_loss_of_the_documents_alone():
    model = _model()
    graphdef, params = nnx.split(model)
    loss = jax.jit(lm_loss(graphdef))  # one compiled program per length
    rows = held_out_rows(["abcdef", "ghi", "jklmnopq"],
                         TokenizeText(lambda: _Mod64()), row_length=9, max_rows=4)
    batch = packed_batch(rows)
    got = float(loss(params, *[jnp.asarray(x) for x in batch]))
    total, count = 0.0, 0
    for r in range(len(batch.inputs)):  # every document piece on its own, unpacked
        for s in set(batch.segment_ids[r].tolist()) - {0}:
            idx = np.flatnonzero(batch.segment_ids[r] == s)
            keep = batch.loss_mask[r, idx] > 0
            if not keep.any():
                continue
            x = jnp.asarray(batch.inputs[r, idx])[None]
            y = jnp.asarray(batch.targets[r, idx])[None]
            n = int(keep.sum())
            total += float(loss(params, x, y, None, None, jnp.asarray(keep)[None])) * n
            count += n
    np.testing.assert_allclose(got, total / count, rtol=1e-5)


class _Mod64(ByteTokenizer):
    vocab_size = 64
    eos_id = 1

    def encode(self, text, *, add_bos=None):
        return [b % 60 + 2 for b in text.encode()]
