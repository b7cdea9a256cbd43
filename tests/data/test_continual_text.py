"""The continual text benchmark: splits, windows, determinism, no train/held-out overlap."""

import zlib

import numpy as np
import pytest

from lowrank_jax.data.continual_text import (
    DOMAINS,
    build_continual_text,
    build_task,
    deduplicate,
    docstring_documents,
    split_documents,
    token_windows,
)


def byte_encode(text):
    return list(text.encode("utf-8"))


def test_token_windows_known_shape_and_content():
    w = token_windows(list(range(10)), 3)
    assert w.shape == (3, 3) and w.dtype == np.int32
    np.testing.assert_array_equal(w, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert token_windows(list(range(10)), 3, max_windows=2).shape == (2, 3)
    with pytest.raises(ValueError, match="length"):
        token_windows([1, 2, 3], 1)


def test_split_is_crc32_rule_and_disjoint():
    docs = [(f"doc{i}", f"text {i}") for i in range(200)]
    train, held = split_documents(docs, heldout_percent=25)
    expected = {s for s, _ in docs if zlib.crc32(s.encode()) % 100 < 25}
    assert {s for s, _ in held} == expected
    assert len(train) + len(held) == 200
    assert not {s for s, _ in train} & {s for s, _ in held}
    assert 30 <= len(held) <= 70  # crc32 spreads 200 names about evenly
    with pytest.raises(ValueError, match="heldout_percent"):
        split_documents(docs, 0)


def test_deduplicate_whitespace_and_empty():
    docs = [("a", "MIT  licence\ntext"), ("b", "MIT licence text"), ("c", "  "), ("d", "other")]
    assert [s for s, _ in deduplicate(docs)] == ["a", "d"]


def test_build_task_known_sizes():
    docs = [(f"doc{i}", "x" * 100) for i in range(40)]
    docs = [(s, f"{i:03d}" + t) for i, (s, t) in enumerate(docs)]  # distinct texts
    task = build_task("toy", docs, byte_encode, length=16, max_chars=10_000, heldout_percent=20)
    n_held = sum(zlib.crc32(s.encode()) % 100 < 20 for s, _ in docs)
    n_train = 40 - n_held
    chars = lambda n: 103 * n + 2 * (n - 1)  # noqa: E731  documents + blank-line joins
    assert task.train.shape == (chars(n_train) // 16, 16)
    assert task.heldout.shape == (chars(n_held) // 16, 16)
    assert len(task.train_sources) == n_train and len(task.heldout_sources) == n_held
    capped = build_task("toy", docs, byte_encode, length=16, max_chars=64,
                        max_heldout_windows=1)
    assert capped.train.shape == (4, 16) and capped.heldout.shape == (1, 16)


def test_docstring_domain_deterministic_and_disjoint():
    opts = dict(length=32, max_chars=6000, max_train_windows=50, max_heldout_windows=20)
    a = build_continual_text(byte_encode, ["docstrings"], **opts)[0]
    b = build_continual_text(byte_encode, ["docstrings"], **opts)[0]
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.heldout, b.heldout)
    assert a.train.shape == (50, 32) and a.heldout.shape[1] == 32
    assert not set(a.train_sources) & set(a.heldout_sources)
    # no held-out window occurs verbatim in the training text
    train_text = bytes(a.train.reshape(-1).astype(np.uint8))
    docs = dict(docstring_documents())
    held_text = "\n\n".join(docs[s] for s in a.heldout_sources).encode()
    assert bytes(a.heldout[0].astype(np.uint8)) == held_text[:32]
    assert sum(bytes(w.astype(np.uint8)) in train_text for w in a.heldout) == 0


def test_every_domain_reads_text_on_this_machine():
    for name in ("licences", "docstrings", "code", "markdown"):
        task = build_continual_text(byte_encode, [name], length=16, max_chars=2000)[0]
        assert task.train.shape[0] >= 10 and task.heldout.shape[0] >= 10, name
    assert set(DOMAINS) >= {"licences", "docstrings", "code", "markdown", "manpages"}
    with pytest.raises(ValueError, match="unknown domains"):
        build_continual_text(byte_encode, ["novels"])


def test_max_chars_none_cuts_to_the_window_caps():
    docs = [(f"doc{i}", f"{i:03d}" + "x" * 2000) for i in range(40)]
    seen = []
    encode = lambda text: seen.append(len(text)) or byte_encode(text)  # noqa: E731
    task = build_task("toy", docs, encode, length=4, max_chars=None, max_train_windows=3,
                      max_heldout_windows=2)
    assert seen == [12 * 4 * 3 + 10_000] * 2  # both splits cut at 12·length·max(caps) + 10k
    assert task.train.shape == (3, 4) and task.heldout.shape == (2, 4)
    with pytest.raises(ValueError, match="max_chars=None"):
        build_task("toy", docs, byte_encode, max_chars=None, max_train_windows=3)
