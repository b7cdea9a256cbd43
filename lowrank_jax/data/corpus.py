"""The embedded corpus: docstrings of a fixed list of standard-library modules, as bytes.

Every Python installation carries this text, so nothing is downloaded; for a given Python version
the corpus is identical on every machine. Tokenization is bytewise (vocabulary 256).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math

import numpy as np

# Fixed, ordered list: changing it changes the corpus (and every number measured on it).
#: The standard-library modules whose docstrings make the built-in byte corpus, in order.
STDLIB_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fileinput", "fnmatch",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "lzma", "mailbox", "mimetypes", "multiprocessing", "netrc",
    "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil", "platform",
    "plistlib", "poplib", "pprint", "profile", "queue", "quopri", "random", "re", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket",
    "socketserver", "sqlite3", "ssl", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "turtle", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zipimport",
)


def module_docstrings(module) -> list[str]:
    """The docstrings of ``module``, in a fixed order: the module's own, then for each class and
    function defined there (sorted by name) its docstring and, for a class, its methods'.

    Example::

        >>> import bisect
        >>> module_docstrings(bisect)[0].startswith("Bisection algorithms")
        True
    """
    texts = []
    doc = inspect.getdoc(module)
    if doc:
        texts.append(doc)
    for name in sorted(vars(module)):
        obj = getattr(module, name)
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
            if inspect.isclass(obj):
                for attr in sorted(vars(obj)):
                    member = vars(obj)[attr]
                    if inspect.isfunction(member) and member.__doc__:
                        texts.append(inspect.getdoc(member))
    return texts


def collect_docstrings(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The docstrings of ``modules`` as they are in *this* interpreter, joined by blank lines.

    Reads the live module objects, so anything this process has patched (a replaced
    ``warnings.showwarning``, a test's mock) changes the text: :func:`corpus_text` runs this in
    a fresh interpreter instead.
    """
    parts = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception:  # a module missing from a stripped-down Python: skip it
            continue
        parts.extend(module_docstrings(module))
    return "\n\n".join(parts)


@functools.lru_cache(maxsize=None)
def corpus_text(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The corpus as one string (docstrings joined by blank lines), deterministic per Python.

    Collected by :func:`collect_docstrings` in a fresh, isolated interpreter (``python -I``,
    with only ``typing_extensions`` imported, as every process of this package has it), so the
    text never depends on what ran before in this process: a library that replaced a
    standard-library function, or a command that routes ``warnings`` while it runs, cannot
    change the corpus (and every batch drawn from it).
    """
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-I", __file__, *modules], capture_output=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(
            f"collecting the embedded corpus in a fresh Python ({sys.executable} -I {__file__}) "
            f"failed with exit code {done.returncode}:\n"
            f"{done.stderr.decode(errors='replace')[-2000:]}")
    return done.stdout.decode("utf-8")


@functools.lru_cache(maxsize=None)
def corpus_bytes(modules: tuple[str, ...] = STDLIB_MODULES) -> np.ndarray:
    """The corpus as a ``uint8`` array of UTF-8 bytes (the byte-level token ids).

    Read-only: every caller gets the same cached array, so writing into it would change the
    corpus for the rest of the process (copy it first: ``corpus_bytes().copy()``).
    """
    tokens = np.frombuffer(corpus_text(modules).encode("utf-8"), dtype=np.uint8).copy()
    tokens.flags.writeable = False
    return tokens


#: Standard-library modules whose Python source makes the ``"code"`` domain of
#: :func:`domain_bytes`, in order.
CODE_MODULES = ("json.decoder", "json.encoder", "csv", "heapq", "bisect", "textwrap", "shlex",
                "fractions", "statistics", "string", "glob", "fnmatch", "copy", "colorsys",
                "base64", "difflib", "calendar", "pprint", "queue", "sched")
CORPUS_DOMAINS = ("docs", "code", "reference")


def domain_bytes(name: str) -> np.ndarray:
    """The UTF-8 bytes of one text domain that ships with Python (no download).

    ``"docs"``: the corpus (:func:`corpus_text`, docstrings); ``"code"``: the Python source of
    :data:`CODE_MODULES`; ``"reference"``: the language-reference prose of
    ``pydoc_data.topics``. Three domains of one language for continued-pretraining studies.

    Raises:
        ValueError: an unknown domain.
        ImportError: ``"reference"`` on a Python without ``pydoc_data``.

    Example::

        >>> code = domain_bytes("code")
        >>> code.dtype, b"def " in code.tobytes()
        (dtype('uint8'), True)
    """
    if name == "docs":
        text = corpus_text()
    elif name == "code":
        parts = []
        for module in CODE_MODULES:
            try:
                parts.append(inspect.getsource(importlib.import_module(module)))
            except (ImportError, OSError, TypeError):
                continue
        text = "\n\n".join(parts)
    elif name == "reference":
        try:
            from pydoc_data.topics import topics
        except ImportError as err:  # stripped-down Pythons lack pydoc_data
            raise ImportError("domain 'reference' needs pydoc_data (part of CPython)") from err
        text = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        raise ValueError(f"unknown domain {name!r}; choose one of {CORPUS_DOMAINS}.")
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.1):
    """Deterministic split: the last ``val_fraction`` of the stream is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1).")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def unigram_entropy_bits(tokens: np.ndarray, vocab_size: int = 256) -> float:
    """Entropy of the empirical byte distribution, in bits per byte (the zero-context baseline)."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int = 0,
             *, rows: slice | None = None):
    """The training batch for ``step``: ``(inputs, targets)`` of shape ``[batch, seq_len]``.

    Windows start at positions drawn from a generator seeded by ``(seed, step)``, so the batch of
    a step never depends on what ran before: a resumed run sees exactly the same data. ``rows``
    selects some rows of that global batch (a process building only its own shard), equal to
    slicing the full batch.
    """
    if len(tokens) < seq_len + 2:
        raise ValueError(f"corpus of {len(tokens)} tokens is shorter than seq_len+1={seq_len + 1}.")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    if rows is not None:
        starts = starts[rows]
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = tokens[idx].astype(np.int32)
    return window[:, :-1], window[:, 1:]


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None):
    """Non-overlapping windows covering ``tokens`` in order (the last partial window dropped)."""
    n = (len(tokens) - 1) // seq_len
    if max_batches is not None:
        n = min(n, max_batches * batch_size)
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens are too few for one window of {seq_len}.")
    for start in range(0, n, batch_size):
        rows = range(start, min(n, start + batch_size))
        window = np.stack([tokens[r * seq_len: r * seq_len + seq_len + 1] for r in rows])
        yield window[:, :-1].astype(np.int32), window[:, 1:].astype(np.int32)


def corpus_windows(encode, n: int, length: int, *, text: str | None = None) -> list[np.ndarray]:
    """``n`` windows of ``length`` token ids from evenly spaced places of the corpus.

    Window ``i`` encodes the text from character ``i·len(text)/n`` on (a span of ``6·length``
    characters, doubled until it gives ``length`` ids) and keeps its first ``length`` ids.

    Args:
        encode: ``str -> list[int]`` (a tokenizer's ``encode``, or bytes).
        n: number of windows; length: ids per window.
        text: the source text (default :func:`corpus_text`).

    Returns:
        ``n`` int32 arrays of ``length`` ids.

    Example::

        >>> encode = lambda s: list(s.encode())
        >>> [w.tolist() for w in corpus_windows(encode, 2, 3, text="abcdefgh")]
        [[97, 98, 99], [101, 102, 103]]
    """
    text = corpus_text() if text is None else text
    out = []
    for i in range(n):
        start = (i * len(text)) // n
        chars = 6 * length
        while True:
            ids = encode(text[start: start + chars])
            if len(ids) >= length or start + chars >= len(text):
                break
            chars *= 2
        if len(ids) < length:
            raise ValueError(f"text too short for window {i} of {length} tokens "
                             f"({len(text)} characters for {n} windows); lower n or length.")
        out.append(np.asarray(ids[:length], np.int32))
    return out


def nats_to_bits(nats: float) -> float:
    """A loss in nats (per byte) as bits: ``nats / ln 2``."""
    return nats / math.log(2.0)


__all__ = ["STDLIB_MODULES", "batch_at", "collect_docstrings", "corpus_bytes", "corpus_text",
           "domain_bytes", "eval_batches", "module_docstrings", "nats_to_bits", "corpus_windows",
           "train_val_split", "unigram_entropy_bits"]


if __name__ == "__main__":  # the fresh interpreter of corpus_text: python -I corpus.py MODULE...
    import sys

    # typing_extensions (which jax, flax and optax import) replaces two of typing's helpers; the
    # corpus has always been read after it, so the child reads it after it too
    import typing_extensions  # noqa: F401

    sys.stdout.buffer.write(collect_docstrings(tuple(sys.argv[1:])).encode("utf-8"))
