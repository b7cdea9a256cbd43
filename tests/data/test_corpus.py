"""The embedded corpus does not depend on what ran before in the process."""

import warnings

import numpy as np
import pytest

from lowrank_jax.data.corpus import collect_docstrings, corpus_bytes, corpus_text


def test_a_patched_standard_library_does_not_change_the_corpus(monkeypatch):
    # what `lowrank_jax.runs.quiet` does while a command runs (and what a user's mock may do)
    monkeypatch.setattr(warnings, "showwarning", lambda *args, **kwargs: None)
    modules = ("warnings", "json")
    live = collect_docstrings(modules)
    assert warnings.showwarning.__doc__ is None
    hook = "Hook to write a warning to a file"  # showwarning's docstring (and its alias's)
    # the live walk lost the docstring of the replaced function ...
    text = corpus_text.__wrapped__(modules)
    assert live.count(hook) == text.count(hook) - 1 >= 1
    # ... the corpus, read in a fresh interpreter, did not
    assert text.startswith(live.split("\n\n")[0]) and len(text) > len(live)
    assert corpus_text.__wrapped__(modules) == text  # deterministic


def test_the_cached_tokens_are_read_only():
    tokens = corpus_bytes()
    assert tokens is corpus_bytes() and tokens.dtype == np.uint8
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 0
    assert bytes(tokens[:64]) == corpus_text().encode("utf-8")[:64]
