"""data.corpus.domain_bytes: the three text domains that ship with Python."""

import numpy as np
import pytest

from lowrank_jax.data import corpus_bytes
from lowrank_jax.data.corpus import domain_bytes


def test_docs_is_the_corpus_and_the_domains_differ():
    np.testing.assert_array_equal(domain_bytes("docs"), corpus_bytes())
    code, reference = domain_bytes("code"), domain_bytes("reference")
    assert b"import " in code.tobytes() and b"def " in code.tobytes()
    assert len(reference) > 10_000 and reference.tobytes()[:200] != code.tobytes()[:200]
    np.testing.assert_array_equal(domain_bytes("code"), code)  # deterministic


def test_unknown_domain_names_the_choices():
    with pytest.raises(ValueError, match="docs"):
        domain_bytes("poetry")
