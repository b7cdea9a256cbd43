"""Heterogeneous federated clients on real text: topic classification of docstring sentences.

The sentences come from the embedded corpus's source (the docstrings of standard-library
modules, :mod:`lowrank_jax.data.corpus`); a sentence's topic is the area of its module
(networking, files, text processing, concurrency, numbers, developer tools). Sentences become
hashed byte n-gram count vectors, and the model is a small frozen MLP whose hidden layers carry
LoRA adapters (the frozen random readout is full rank, so the adapters alone can fit the task).

Heterogeneity, per client: topic proportions drawn from a Dirichlet (non-IID data), a resource
tier (trainable and downloadable rank), and optionally a label-map group (clients of different
groups name the same topics differently — functional heterogeneity for personalised methods).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from lowrank_jax.data.corpus import module_docstrings
from lowrank_jax.federated.simulator import Client
from lowrank_jax.nn import LoRARule, apply_lora

TOPICS = {
    "networking": ("ftplib", "http.client", "http.server", "imaplib", "poplib", "smtplib",
                   "socket", "socketserver", "ssl", "urllib.parse", "urllib.request",
                   "ipaddress"),
    "files": ("gzip", "lzma", "tarfile", "zipfile", "zipimport", "shutil", "pathlib", "tempfile",
              "glob", "fnmatch", "fileinput", "os", "io"),
    "text": ("string", "textwrap", "re", "difflib", "shlex", "html", "codecs", "csv", "json",
             "gettext", "quopri", "base64"),
    "concurrency": ("asyncio", "threading", "multiprocessing", "concurrent.futures", "queue",
                    "sched", "subprocess", "signal", "selectors"),
    "numbers": ("decimal", "fractions", "numbers", "statistics", "random", "bisect", "heapq",
                "operator", "calendar", "datetime"),
    "devtools": ("unittest", "pdb", "profile", "trace", "traceback", "inspect", "ast",
                 "tokenize", "timeit", "warnings", "logging"),
}

# (name, train_rank, download_rank, probability): FedHera's setting B shape at CPU scale.
DEFAULT_TIERS = (("low", 2, 8, 0.3), ("medium", 4, 12, 0.5), ("high", 8, 16, 0.2))


@functools.cache
def topic_sentences(min_chars: int = 40, max_chars: int = 400):
    """``(sentences, labels)``: every docstring sentence of ``min_chars..max_chars`` characters
    of the :data:`TOPICS` modules, labelled by topic index (deterministic per Python version)."""
    texts, labels = [], []
    for label, modules in enumerate(TOPICS.values()):
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ImportError:  # a module missing from a stripped-down Python: skip it
                continue
            for doc in module_docstrings(module):
                for sentence in re.split(r"(?<=[.!?])\s+|\n\s*\n", doc):
                    sentence = " ".join(sentence.split())
                    if min_chars <= len(sentence) <= max_chars:
                        texts.append(sentence)
                        labels.append(label)
    return tuple(texts), np.array(labels, np.int32)


def hashed_ngram_features(texts: Sequence[str], dim: int = 512, orders=(1, 2, 3)) -> np.ndarray:
    """``[n, dim]`` float32: log(1 + counts) of byte n-grams hashed into ``dim`` buckets, rows
    L2-normalised. The hash is a fixed multiplicative one (no Python ``hash``), so it is stable."""
    if dim < 2:
        raise ValueError(f"dim={dim} must be >= 2.")
    out = np.zeros((len(texts), dim), np.float32)
    for row, text in enumerate(texts):
        b = np.frombuffer(text.lower().encode("utf-8"), np.uint8).astype(np.uint64)
        codes = []
        for n in orders:
            if len(b) < n:
                continue
            h = np.full(len(b) - n + 1, np.uint64(n), np.uint64)
            for j in range(n):
                h = h * np.uint64(1_000_003) + b[j: len(b) - n + 1 + j]
            codes.append((h * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40))
        if codes:
            out[row] = np.bincount(np.concatenate(codes) % np.uint64(dim), minlength=dim)
    out = np.log1p(out)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


class TopicClassifier(nnx.Module):
    """``x [b, features] -> logits [b, classes]``: ``depth`` hidden layers (``layers/0..``,
    GELU) and a readout ``head``; :func:`topic_model` adapts the hidden layers with LoRA."""

    def __init__(self, features: int, hidden: int, classes: int, *, depth: int = 4,
                 rngs: nnx.Rngs):
        sizes = [features] + [hidden] * depth
        self.layers = nnx.List([nnx.Linear(sizes[i], sizes[i + 1], rngs=rngs)
                                for i in range(depth)])
        self.head = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)


def topic_model(*, features: int = 512, hidden: int = 64, classes: int = len(TOPICS),
                depth: int = 4, rank: int = 16, alpha: float | None = None, seed: int = 0):
    """A frozen random :class:`TopicClassifier` with rank-``rank`` LoRA on every hidden layer."""
    model = TopicClassifier(features, hidden, classes, depth=depth, rngs=nnx.Rngs(seed))
    apply_lora(model, LoRARule(r"^layers/", rank=rank, alpha=alpha), rngs=nnx.Rngs(seed + 1))
    return model


def make_topic_clients(n_clients: int, *, seed: int = 0, dirichlet_alpha: float = 0.5,
                       train_per_client: int = 120, test_per_client: int = 60,
                       tiers=DEFAULT_TIERS, label_groups: int = 1, features: int = 512):
    """Heterogeneous clients on the topic task.

    Args:
        n_clients: how many clients.
        seed: drives the topic mixtures, tiers, label maps and the samples.
        dirichlet_alpha: concentration of each client's topic proportions (smaller = more
            non-IID).
        train_per_client, test_per_client: sentences per client (train and test come from
            disjoint halves of the sentence pool).
        tiers: ``(name, train_rank, download_rank, probability)`` resource tiers.
        label_groups: clients are split round-robin into this many groups; group ``g > 0``
            relabels the topics by a fixed permutation (group 0 keeps the true labels).
        features: hashed n-gram dimension.

    Returns:
        ``(clients, groups [N])``.
    """
    if n_clients < 1 or label_groups < 1 or dirichlet_alpha <= 0:
        raise ValueError(f"n_clients={n_clients}, label_groups={label_groups} must be >= 1 and "
                         f"dirichlet_alpha={dirichlet_alpha} > 0.")
    probs = np.array([t[3] for t in tiers], np.float64)
    if len(tiers) == 0 or np.any(probs < 0) or probs.sum() <= 0:
        raise ValueError("tiers must be (name, train_rank, download_rank, probability) tuples "
                         "with non-negative probabilities.")
    texts, labels = topic_sentences()
    x_all = hashed_ngram_features(texts, features)
    classes = len(TOPICS)
    rng = np.random.default_rng(seed)
    in_test = np.random.default_rng(12345).random(len(labels)) < 0.5  # fixed split
    pools = {(split, c): np.flatnonzero((labels == c) & (in_test == split))
             for split in (False, True) for c in range(classes)}
    perms = [np.arange(classes)] + [rng.permutation(classes) for _ in range(label_groups - 1)]
    tier_ids = rng.choice(len(tiers), size=n_clients, p=probs / probs.sum())
    clients, groups = [], np.arange(n_clients) % label_groups
    for i in range(n_clients):
        mix = rng.dirichlet(np.full(classes, dirichlet_alpha))

        perm = perms[groups[i]]
        drawn = []
        for split, count in ((False, train_per_client), (True, test_per_client)):
            topics = rng.choice(classes, size=count, p=mix)
            idx = np.array([rng.choice(pools[(split, int(c))]) for c in topics])
            drawn += [x_all[idx], perm[labels[idx]].astype(np.int32)]
        train_x, train_y, test_x, test_y = drawn
        name, train_rank, download_rank, _ = tiers[tier_ids[i]]
        clients.append(Client(train_x, train_y, test_x, test_y, train_rank=int(train_rank),
                              download_rank=int(download_rank), tier=str(name)))
    return clients, groups
