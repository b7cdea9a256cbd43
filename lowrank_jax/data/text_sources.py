"""A user's text corpus as random-access documents: folders or globs of ``.txt``, ``.jsonl``,
``.parquet`` and ArrayRecord files, checked once before any training work.

One document is a whole ``.txt`` file, one line of a ``.jsonl`` file (its ``text_field``), one
row of a ``.parquet`` file (its ``text_field`` column) or one record of an ArrayRecord file
(``.arrayrecord`` / ``.array_record``: UTF-8 text). :func:`index_documents` reads every file once,
builds the index (file, line offset / row / record) and refuses bad data with one line that names
the file (and line): an empty folder, a file that is not UTF-8, a line that is not JSON or has no
such field. Documents that are empty or only white space are left out.

:class:`TextDocuments` is a grain ``RandomAccessDataSource`` (``len`` and ``[i]``): it pickles
as the index alone and reopens files lazily, so grain worker processes can read it.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib

import numpy as np

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrayrecord", ".array_record")
PYARROW_INSTALL = "pip install pyarrow"


class DataError(ValueError):
    """Bad training data: the one-line message names the file (and line) and the fix."""


def find_data_files(path: str | os.PathLike) -> list[pathlib.Path]:
    """The data files behind ``path``: a file, a folder (searched recursively) or a glob.

    Example::

        >>> import tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "a.txt").write_text("hello")
        >>> [p.name for p in find_data_files(folder)]
        ['a.txt']
    """
    text = os.fspath(path)
    if any(c in text for c in "*?["):
        files = sorted(pathlib.Path(p) for p in glob.glob(text, recursive=True)
                       if os.path.isfile(p))
        if not files:
            raise DataError(f"data={text}: the pattern matches no file.")
    elif os.path.isdir(text):
        files = sorted(p for p in pathlib.Path(text).rglob("*")
                       if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"data={text}: the folder is empty; put .txt, .jsonl, .parquet "
                            "or .arrayrecord files in it.")
    elif os.path.isfile(text):
        files = [pathlib.Path(text)]
    else:
        raise DataError(f"data={text}: no such file or folder.")
    supported = [p for p in files if p.name.endswith(TEXT_SUFFIXES)]
    if not supported:
        names = ", ".join(p.name for p in files[:3]) + (", ..." if len(files) > 3 else "")
        raise DataError(f"data={text}: no .txt, .jsonl, .parquet or .arrayrecord file "
                        f"(found {names}).")
    return supported


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                        f"{err.start}); convert the file to UTF-8 or remove it.") from None


def _jsonl_text(line: bytes, where: str, field: str) -> str:
    text = _utf8(line, where)
    try:
        record = json.loads(text)
    except ValueError as err:
        raise DataError(f"{where}: not a JSON line ({err.msg} at column {err.colno}); "
                        "each line of a .jsonl file must be one JSON object.") from None
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(list(record)[:6]) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no field {field!r} (has: {keys}); name the text field with "
                        "`text_field`.")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, not text.")
    return value


def _parquet_column(path: pathlib.Path, field: str) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet files needs pyarrow: {PYARROW_INSTALL} "
                        "(or convert the data to .jsonl).") from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow's errors have no common base
        raise DataError(f"{path}: unreadable parquet file ({str(err).splitlines()[0]}).") from None
    if field not in table.column_names:
        raise DataError(f"{path}: no column {field!r} (has: {', '.join(table.column_names[:6])}); "
                        "name the text column with `text_field`.")
    return table.column(field).to_pylist()


def _array_record(path: pathlib.Path):
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        return ArrayRecordReader(str(path))
    except Exception as err:  # noqa: BLE001 - the C++ reader's status errors
        raise DataError(f"{path}: unreadable ArrayRecord file ({str(err).splitlines()[0]}).") \
            from None


class TextDocuments:
    """Random-access documents of a set of files (a grain ``RandomAccessDataSource``).

    Build it with :func:`index_documents`. ``docs[i]`` is the text of document ``i``;
    ``docs.subset(ids)`` is the documents ``ids`` as a new source (the held-out split).
    """

    def __init__(self, files: list[str], kinds: list[str], file_ids: np.ndarray,
                 offsets: np.ndarray, text_field: str):
        self.files, self.kinds = list(files), list(kinds)
        self.file_ids = np.asarray(file_ids, np.int32)
        self.offsets = np.asarray(offsets, np.int64)
        self.text_field = text_field
        self._open: dict = {}

    def __len__(self) -> int:
        return len(self.file_ids)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"] = {}  # file handles and parquet columns are reopened where unpickled
        return state

    def __repr__(self) -> str:
        return f"TextDocuments({len(self)} documents in {len(self.files)} files)"

    def subset(self, ids) -> "TextDocuments":
        ids = np.asarray(ids, np.int64)
        return TextDocuments(self.files, self.kinds, self.file_ids[ids], self.offsets[ids],
                             self.text_field)

    def __getitem__(self, index: int) -> str:
        index = int(index)
        f, at = int(self.file_ids[index]), int(self.offsets[index])
        kind, path = self.kinds[f], self.files[f]
        if kind == "txt":
            return pathlib.Path(path).read_bytes().decode("utf-8")
        if kind == "jsonl":
            handle = self._open.get(f) or self._open.setdefault(f, open(path, "rb"))
            handle.seek(at)
            return json.loads(handle.readline().decode("utf-8"))[self.text_field]
        if kind == "parquet":
            if f not in self._open:
                self._open[f] = _parquet_column(pathlib.Path(path), self.text_field)
            return self._open[f][at]
        if f not in self._open:
            self._open[f] = _array_record(pathlib.Path(path))
        return self._open[f].read([at])[0].decode("utf-8")

    def total_bytes(self) -> int:
        """An upper bound of the documents' UTF-8 bytes (their files' sizes)."""
        used = np.unique(self.file_ids)
        return int(sum(os.path.getsize(self.files[f]) for f in used))


def index_documents(path: str | os.PathLike, *, text_field: str = "text") -> TextDocuments:
    """Find, check and index every document under ``path`` (see the module docstring).

    Raises:
        DataError: one line naming the bad file (``file:line`` for a ``.jsonl`` line).

    Example::

        >>> import tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "a.jsonl").write_text('{"text": "one"}\\n\\n{"text": "two"}\\n')
        >>> docs = index_documents(folder)
        >>> len(docs), docs[1]
        (2, 'two')
    """
    if not isinstance(text_field, str) or not text_field:
        raise DataError(f"text_field={text_field!r}: give the name of the JSON field / parquet "
                        "column that holds the text.")
    files, kinds, file_ids, offsets = [], [], [], []
    for path_ in find_data_files(path):
        name, f = path_.name, len(files)
        files.append(str(path_))
        if name.endswith(".txt"):
            kinds.append("txt")
            if _utf8(path_.read_bytes(), str(path_)).strip():
                file_ids.append(f)
                offsets.append(0)
        elif name.endswith(".jsonl"):
            kinds.append("jsonl")
            at = 0
            with open(path_, "rb") as handle:
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        if _jsonl_text(line, f"{path_}:{number}", text_field).strip():
                            file_ids.append(f)
                            offsets.append(at)
                    at += len(line)
        elif name.endswith(".parquet"):
            kinds.append("parquet")
            for row, value in enumerate(_parquet_column(path_, text_field)):
                if isinstance(value, str) and value.strip():
                    file_ids.append(f)
                    offsets.append(row)
        else:
            kinds.append("arrayrecord")
            reader = _array_record(path_)
            for record in range(reader.num_records()):
                if _utf8(reader.read([record])[0], f"{path_} record {record}").strip():
                    file_ids.append(f)
                    offsets.append(record)
            reader.close()
    if not file_ids:
        raise DataError(f"data={os.fspath(path)}: the files hold no text (every document is "
                        "empty).")
    return TextDocuments(files, kinds, np.asarray(file_ids), np.asarray(offsets), text_field)


__all__ = ["DataError", "TextDocuments", "find_data_files", "index_documents"]
