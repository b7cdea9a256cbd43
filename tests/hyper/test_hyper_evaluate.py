"""Answer scoring, the distillation floor, and the needle documents (known answers)."""

import jax.numpy as jnp
import numpy as np

from lowrank_jax.hyper import DistillData, answer_scores, pad_tokens, teacher_floor
from lowrank_jax.hyper.needles import TEST_NAMES, TRAIN_NAMES, make_documents, tokenize


def test_answer_scores_known_answer():
    # two rows; row 0 right on both answer tokens, row 1 wrong on its second (digit) token
    p = np.full((2, 3, 4), 0.1, np.float32)
    p[0, 1, 2], p[0, 2, 3] = 0.7, 0.7
    p[1, 0, 1], p[1, 1, 0] = 0.7, 0.7
    hits, lps, digits = answer_scores(jnp.log(jnp.asarray(p)), jnp.zeros((2, 3), int),
                                      [1, 0], [[2, 3], [1, 2]])
    assert hits == [True, False]
    np.testing.assert_allclose(lps, [2 * np.log(0.7), np.log(0.7) + np.log(0.1)], rtol=1e-5)
    assert digits == [1.0, 0.0]


def test_teacher_floor_is_the_weighted_entropy():
    logp = np.log(np.array([[[0.5, 0.5], [1.0, 1e-30]]]))
    data = DistillData(*([None] * (len(DistillData._fields) - 3)), np.array([[1.0, 3.0]]),
                       logp, np.zeros((1, 2, 2), int))
    np.testing.assert_allclose(teacher_floor(data), np.log(2) / 4, rtol=1e-6)


def test_needle_documents_are_seeded_and_answerable():
    docs = make_documents(np.random.default_rng(0), 3, TRAIN_NAMES, list(range(10, 100)), 2, 7)
    again = make_documents(np.random.default_rng(0), 3, TRAIN_NAMES, list(range(10, 100)), 2, 7)
    assert docs == again and not {d["name"] for d in docs} & set(TEST_NAMES)
    for d in docs:
        assert f"The secret code of {d['name']} is {d['code']}." in d["doc"]

    class Chars:
        def encode(self, text, add_bos=False):
            return [ord(c) for c in text]

    documents, questions, answers = tokenize(Chars(), docs)
    assert "".join(map(chr, answers[0])) == f" {docs[0]['code']}"
    assert pad_tokens(questions).shape == (3, max(map(len, questions)))
