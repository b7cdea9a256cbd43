"""A continual-learning text benchmark built from files that ship with the machine: no download.

Five *domains* with different formats, each read from text every Linux + Python install carries:

* ``licences``   — licence files of the installed packages (``*.dist-info/LICENSE*``,
  ``*.dist-info/licenses/*``) and ``/usr/share/common-licenses``: legal prose;
* ``docstrings`` — the docstrings of :data:`lowrank_jax.data.STDLIB_MODULES` (module, public
  classes and functions): reference prose with code examples;
* ``code``       — the Python source of the other top-level standard-library modules (those not in
  ``STDLIB_MODULES``, so ``docstrings`` and ``code`` do not share a module);
* ``markdown``   — the long descriptions (README bodies) in the packages' ``METADATA`` files;
* ``manpages``   — roff sources of ``/usr/share/man/man1/*.gz`` (a deterministic stride sample);
  where a container has no man pages, GNU ``/usr/share/info/*.info*`` files instead.

Each domain is a list of *documents* ``(source, text)`` in sorted source order, deduplicated by
content. A document goes to the held-out split when ``crc32(source) % 100 < heldout_percent``, so
the split is a pure function of the file name (adding a file never moves another one), and no
document is in both splits. Each split is joined with blank lines, cut to ``max_chars``,
tokenized with the caller's ``encode`` and cut into non-overlapping ``[n, length]`` windows.

The exact text depends on the installed Python, packages and Debian packages, so the numbers
measured on it are reproducible on one machine (or one image), not across machines; every
:class:`TextTask` records its sources so a result can say what it read.

Example::

    >>> encode = lambda text: list(text.encode("utf-8"))
    >>> tasks = build_continual_text(encode, ["docstrings"], length=32, max_chars=4000)
    >>> tasks[0].train.shape[1], tasks[0].name
    (32, 'docstrings')
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
import warnings
import zlib
from typing import Callable, Sequence

import numpy as np

from lowrank_jax.data.corpus import STDLIB_MODULES

Document = tuple[str, str]
DOMAINS = ("licences", "docstrings", "code", "markdown", "manpages")


@dataclasses.dataclass(frozen=True)
class TextTask:
    """One domain: ``train`` and ``heldout`` token windows ``[n, length]`` and their sources."""

    name: str
    train: np.ndarray
    heldout: np.ndarray
    train_sources: tuple[str, ...]
    heldout_sources: tuple[str, ...]


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def _site_packages() -> list[str]:
    return sorted({p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)}
                  | {sysconfig.get_paths()["purelib"]})


def licence_documents() -> list[Document]:
    """Licence files of the installed distributions and ``/usr/share/common-licenses``."""
    paths = []
    for site in _site_packages():
        paths += glob.glob(os.path.join(site, "*.dist-info", "LICEN[CS]E*"))
        paths += glob.glob(os.path.join(site, "*.dist-info", "licenses", "**", "*"),
                           recursive=True)
    paths += glob.glob("/usr/share/common-licenses/*")
    return [(p, _read(p)) for p in sorted(set(paths)) if os.path.isfile(p)]


def docstring_documents(modules: Sequence[str] = STDLIB_MODULES) -> list[Document]:
    """One document per module: its docstring and those of its public classes and functions."""
    docs = []
    for name in modules:
        with warnings.catch_warnings():  # e.g. typing.io's DeprecationWarning on access
            warnings.simplefilter("ignore", DeprecationWarning)
            docs.append((f"doc:{name}", _module_docs(importlib.import_module(name))))
    return docs


def _module_docs(module) -> str:
    parts = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            parts.append(f"{attr}: {inspect.getdoc(obj) or ''}")
    return "\n\n".join(p for p in parts if p.strip())


def code_documents(exclude: Sequence[str] = STDLIB_MODULES) -> list[Document]:
    """The source of every top-level standard-library ``.py`` module not in ``exclude``."""
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = {m.split(".")[0] for m in exclude}
    paths = [p for p in sorted(glob.glob(os.path.join(stdlib, "*.py")))
             if os.path.basename(p)[:-3] not in skip and not os.path.basename(p).startswith("_")]
    return [(p, _read(p)) for p in paths]


def markdown_documents() -> list[Document]:
    """The long description (the body after the header block) of each ``METADATA`` file."""
    docs = []
    for site in _site_packages():
        for path in sorted(glob.glob(os.path.join(site, "*.dist-info", "METADATA"))):
            text = _read(path)
            _, sep, body = text.partition("\n\n")
            if sep and body.strip():
                docs.append((path, body))
    return docs


def manpage_documents(max_documents: int = 400) -> list[Document]:
    """A stride sample of ``max_documents`` man(1) roff sources; GNU info files without them."""
    paths = sorted(glob.glob("/usr/share/man/man1/*.gz"))
    if not paths:
        paths = sorted(glob.glob("/usr/share/info/*.info*"))
    if not paths:
        raise ValueError("manpages: neither /usr/share/man/man1 nor /usr/share/info holds "
                         "any file on this machine; choose other domains from "
                         f"{DOMAINS}.")
    stride = max(1, len(paths) // max_documents)
    return [(p, _read(p)) for p in paths[::stride][:max_documents]]


READERS: dict[str, Callable[[], list[Document]]] = {
    "licences": licence_documents,
    "docstrings": docstring_documents,
    "code": code_documents,
    "markdown": markdown_documents,
    "manpages": manpage_documents,
}


def deduplicate(documents: Sequence[Document]) -> list[Document]:
    """Drop empty documents and later copies of a text seen before (whitespace-normalised)."""
    seen, out = set(), []
    for source, text in documents:
        key = hashlib.sha1(" ".join(text.split()).encode("utf-8")).hexdigest()
        if text.strip() and key not in seen:
            seen.add(key)
            out.append((source, text))
    return out


def split_documents(documents: Sequence[Document], heldout_percent: int = 20
                    ) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)``: a document is held out when ``crc32(source) % 100 < percent``."""
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent={heldout_percent} must lie in (0, 100).")
    train, heldout = [], []
    for doc in documents:
        held = zlib.crc32(doc[0].encode("utf-8")) % 100 < heldout_percent
        (heldout if held else train).append(doc)
    return train, heldout


def token_windows(ids: Sequence[int], length: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping ``[n, length]`` int32 windows from the start of ``ids`` (tail dropped)."""
    if length < 2:
        raise ValueError(f"length={length} must be at least 2 (an input and a target).")
    n = len(ids) // length
    if max_windows is not None:
        n = min(n, max_windows)
    return np.asarray(ids[: n * length], np.int32).reshape(n, length)


def build_task(name: str, documents: Sequence[Document], encode: Callable[[str], list[int]], *,
               length: int = 64, max_chars: int | None = 200_000,
               max_train_windows: int | None = None, max_heldout_windows: int | None = None,
               heldout_percent: int = 20) -> TextTask:
    """Deduplicate, split, join (blank lines), cut to ``max_chars``, tokenize, window.

    ``max_chars=None`` sizes the cut to the window caps: ``12 · length · max(caps) + 10,000``
    characters (about 3 characters per token, with room to spare), so a few windows of a large
    domain do not tokenize the whole of it.
    """
    if max_chars is None:
        if max_train_windows is None or max_heldout_windows is None:
            raise ValueError("build_task: max_chars=None needs max_train_windows and "
                             "max_heldout_windows (the cut is sized to them).")
        max_chars = 12 * length * max(max_train_windows, max_heldout_windows) + 10_000
    train, heldout = split_documents(deduplicate(documents), heldout_percent)
    if not train or not heldout:
        raise ValueError(f"task {name!r}: {len(train)} train and {len(heldout)} held-out "
                         "documents; each split needs at least one (lower heldout_percent or "
                         "add documents).")

    def windows(docs, cap):
        text = "\n\n".join(t for _, t in docs)[:max_chars]
        out = token_windows(encode(text), length, cap)
        if len(out) == 0:
            raise ValueError(f"task {name!r}: fewer than {length} tokens in a split; raise "
                             "max_chars.")
        return out

    return TextTask(name, windows(train, max_train_windows), windows(heldout, max_heldout_windows),
                    tuple(s for s, _ in train), tuple(s for s, _ in heldout))


def build_continual_text(encode: Callable[[str], list[int]],
                         domains: Sequence[str] = ("licences", "manpages", "code", "markdown"),
                         **task_options) -> list[TextTask]:
    """One :class:`TextTask` per domain name in ``domains`` (see :data:`DOMAINS`), in order.

    Args:
        encode: text → token ids (the model's tokenizer, or bytes for a byte model).
        domains: the task order of the stream.
        task_options: forwarded to :func:`build_task` (``length``, ``max_chars``,
            ``max_train_windows``, ``max_heldout_windows``, ``heldout_percent``).
    """
    unknown = [d for d in domains if d not in READERS]
    if unknown:
        raise ValueError(f"unknown domains {unknown}; choose from {DOMAINS}.")
    return [build_task(d, READERS[d](), encode, **task_options) for d in domains]


__all__ = ["DOMAINS", "READERS", "TextTask", "build_continual_text", "build_task",
           "code_documents", "deduplicate", "docstring_documents", "licence_documents",
           "manpage_documents", "markdown_documents", "split_documents", "token_windows"]
