"""Needle-in-a-haystack documents: filler sentences around one fact, and its question.

Each document hides "The secret code of NAME is NN." among filler sentences; the question
"What is the secret code of NAME? The secret code of NAME is" is answered by the code's tokens.
Test names never occur in training, and codes come from a closed vocabulary (10..99 in
``scripts/reproduce/doc_to_lora.py``), so answering without the document in the prompt needs
the fact internalised from the document (an adapter that ignores the document guesses, 1 in 90).

Two document sets: :func:`make_documents` (12 fixed filler sentences, :data:`TRAIN_NAMES` /
:data:`TEST_NAMES`) and :func:`make_varied_documents` (template filler, 14 x 16 x 16 sentences,
a distinct (name, code) pair per document, :data:`VARIED_TRAIN_NAMES` /
:data:`VARIED_TEST_NAMES`).

References:
    Charakorn et al., `Doc-to-LoRA <https://arxiv.org/abs/2602.15902>`_, 2026.
"""

from __future__ import annotations

FILLER = [
    "The grass is green and the sky is blue.", "A river flows quietly past the old mill.",
    "Children played in the park until sunset.", "The market opens early on Saturday.",
    "Rain fell softly on the tiled roofs.", "An old clock ticked in the hallway.",
    "The baker sold fresh bread every morning.", "Birds sang in the tall oak trees.",
    "The train left the station on time.", "Snow covered the distant mountains.",
    "A cat slept on the warm windowsill.", "The library was calm and full of books.",
]
TRAIN_NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene",
               "James", "Karen", "Louis", "Maria", "Nathan", "Olivia", "Peter", "Rachel",
               "Simon", "Tina", "Victor"]
TEST_NAMES = ["Wendy", "Xavier", "Yolanda", "Zachary", "Ursula", "Quentin", "Beatrice", "Oscar"]

# Template filler (14 x 16 x 16 = 3584 sentences), 156 training names x 90 codes (14,040 pairs,
# each training document a fresh pair), 40 test names that never occur in training.
SUBJECTS = ["The farmer", "A small boy", "The old teacher", "My neighbour", "The doctor",
            "A tired traveller", "The young painter", "Our captain", "The shopkeeper",
            "A quiet student", "The mayor", "An old fisherman", "The gardener", "A nurse"]
ACTIONS = ["walked slowly", "sang a song", "read a letter", "drank some tea", "waited",
           "fixed a bicycle", "cooked dinner", "wrote a poem", "found a coin", "lost a glove",
           "painted a fence", "fed the ducks", "took a photo", "sold apples", "counted sheep",
           "lit a candle"]
PLACES = ["near the river", "in the garden", "at the station", "by the sea", "in the kitchen",
          "on the hill", "behind the school", "at the market", "in the forest", "on the bridge",
          "under the bridge", "in the village", "at the harbour", "on the farm",
          "in the library", "at noon"]
VARIED_TRAIN_NAMES = (TRAIN_NAMES + """Aaron Abigail Adam Adrian Agnes Albert Alex Amanda Amber Amy
    Andrew Angela Anna Anthony Arthur Audrey Barbara Ben Bernard Betty Bill Brandon Brian Bruce
    Carl Caroline Catherine Charles Charlotte Chris Claire Clara Colin Daniel Diana Donald Doris
    Dorothy Edward Eleanor Elijah Eliza Ellen Emily Eric Ethan Eva Evelyn Felix Fiona Florence
    Frances George Gerald Gloria Gordon Hannah Harold Harry Helen Howard Hugo Ian Isaac Ivan Jack
    Jacob Jane Janet Jason Jean Jeffrey Jennifer Jessica Joan John Joseph Joyce Julia Julian
    Justin Keith Kevin Laura Lawrence Leo Linda Lisa Lucy Luke Margaret Mark Martha Martin Mary
    Matthew Megan Michael Monica Nancy Neil Nicole Noah Norman Oliver Pamela Patrick Paul
    Philip Ralph Raymond Rebecca Richard Robert Roger Ronald Rose Roy Ruth Ryan Samuel Sandra
    Sarah Scott Sharon Sophia Stephen Steven Susan Thomas Timothy Tony Vera Walter Wayne
    William""".split())
VARIED_TEST_NAMES = TEST_NAMES + """Agatha Ambrose Barnaby Cedric Cornelia Desmond Dolores
    Edmund Esther Gideon Gwendolyn Horace Imogen Jasper Lavinia Leopold Lorna Mabel Marcus
    Mildred Murray Octavia Percival Priscilla Reginald Rosalind Rupert Silas Theodora Winifred
    Ophelia Ignatius""".split()


def make_varied_documents(rng, n, names, codes, min_filler, max_filler, exclude=()):
    """``n`` documents ``{"doc", "name", "code"}``, each a distinct (name, code) pair (none in
    ``exclude``), the fact inserted among ``min_filler..max_filler`` template sentences.

    Args:
        rng: a ``numpy.random.Generator``.
        n: how many documents.
        names, codes: the names and integer codes to pair.
        min_filler, max_filler: the number of filler sentences (inclusive bounds).
        exclude: (name, code) pairs not to use.

    Example::

        >>> import numpy as np
        >>> docs = make_varied_documents(np.random.default_rng(0), 2, ["Ann"], [10, 11], 1, 1)
        >>> sorted(d["code"] for d in docs), "The secret code of Ann is" in docs[0]["doc"]
        ([10, 11], True)
    """
    pairs = [(a, c) for a in names for c in codes if (a, c) not in set(exclude)]
    if n > len(pairs):
        raise ValueError(f"{n} documents need {n} distinct (name, code) pairs; "
                         f"only {len(pairs)} exist.")
    docs = []
    for j in rng.choice(len(pairs), n, replace=False):
        name, code = pairs[int(j)]
        k = int(rng.integers(min_filler, max_filler + 1))
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(PLACES)}."
                     for _ in range(k)]
        sentences.insert(int(rng.integers(0, k + 1)), f"The secret code of {name} is {code}.")
        docs.append({"doc": " ".join(sentences), "name": name, "code": int(code)})
    return docs


def make_documents(rng, n, names, codes, min_filler, max_filler):
    """``n`` documents ``{"doc", "name", "code"}``: a random (name, code) fact among
    ``min_filler..max_filler`` sentences of :data:`FILLER` (pairs may repeat).

    Example::

        >>> import numpy as np
        >>> doc = make_documents(np.random.default_rng(0), 1, ["Ann"], [42], 0, 0)[0]
        >>> doc["doc"]
        'The secret code of Ann is 42.'
    """
    docs = []
    for _ in range(n):
        name, code = str(rng.choice(names)), int(rng.choice(codes))
        k = int(rng.integers(min_filler, max_filler + 1))
        sentences = [FILLER[i] for i in rng.choice(len(FILLER), k, replace=True)]
        sentences.insert(int(rng.integers(0, k + 1)), f"The secret code of {name} is {code}.")
        docs.append({"doc": " ".join(sentences), "name": name, "code": code})
    return docs


def tokenize(tok, docs):
    """``(documents, questions, answers)`` token lists of ``docs`` with tokenizer ``tok``: the
    document (plus a newline), the question ending in "... is", and the answer `` NN``.

    Example::

        >>> class Chars:
        ...     def encode(self, text, add_bos=False):
        ...         return [ord(c) for c in text]
        >>> _, _, answers = tokenize(Chars(), [{"doc": "x", "name": "Ann", "code": 42}])
        >>> answers
        [[32, 52, 50]]
    """
    documents = [tok.encode(d["doc"] + "\n", add_bos=False) for d in docs]
    questions = [tok.encode(f"What is the secret code of {d['name']}? The secret code of "
                            f"{d['name']} is", add_bos=False) for d in docs]
    answers = [tok.encode(f" {d['code']}", add_bos=False) for d in docs]
    return documents, questions, answers


__all__ = ["FILLER", "TEST_NAMES", "TRAIN_NAMES", "VARIED_TEST_NAMES", "VARIED_TRAIN_NAMES",
           "make_documents", "make_varied_documents", "tokenize"]
