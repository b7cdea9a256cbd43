"""Evenly spaced token windows of a text."""

import numpy as np
import pytest

from lowrank_jax.data import corpus_windows


def test_windows_start_at_evenly_spaced_characters():
    text = "".join(chr(97 + i % 26) for i in range(100))
    windows = corpus_windows(lambda s: [ord(c) for c in s], 4, 5, text=text)
    assert [w[0] for w in windows] == [ord(text[i]) for i in (0, 25, 50, 75)]
    assert all(w.dtype == np.int32 and len(w) == 5 for w in windows)


def test_a_sparse_encoding_doubles_the_span_and_a_short_text_raises():
    text = "ab" * 100  # one id per 2 characters: 6·length characters are not enough
    ids = corpus_windows(lambda s: [1] * (len(s) // 2), 2, 8, text=text)
    assert [len(w) for w in ids] == [8, 8]
    with pytest.raises(ValueError, match="too short"):
        corpus_windows(lambda s: list(s.encode()), 2, 80, text="x" * 100)
