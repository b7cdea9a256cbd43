"""The result record of a reproduction: a JSON file and a Markdown note with its table.

``<stem>.json`` holds ``{"title", "date", "machine", "command", "columns", "rows",
"verdict", ...extra}``; ``<stem>.md`` shows the title, the command that produced it, the table
of ``rows`` (one ``dict`` per row, keyed by ``columns``), the verdict and an optional note.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys
from collections.abc import Sequence

from lowrank_jax.runs.outputs import atomic_write_text


def machine_line() -> str:
    """``host arch N cores, JAX x.y.z (backend)``: where a result was measured."""
    import jax

    return (f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, JAX "
            f"{jax.__version__} ({jax.default_backend()})")


def run_command() -> str:
    """The command line of this process as ``python -m <module> <args>``."""
    main = sys.modules["__main__"]
    name = getattr(getattr(main, "__spec__", None), "name", None) or sys.argv[0]
    return f"python -m {name} " + " ".join(sys.argv[1:])


def format_cell(value) -> str:
    """A table cell: floats to 4 significant digits, anything else as ``str``.

    Example::

        >>> format_cell(3.14159), format_cell(12), format_cell("±")
        ('3.142', '12', '±')
    """
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[dict]) -> list[str]:
    """The lines of a Markdown table of ``rows`` (dicts keyed by ``columns``).

    Example::

        >>> print("\\n".join(markdown_table(["arm", "nll"], [{"arm": "lora", "nll": 1.23456}])))
        | arm | nll |
        |---|---|
        | lora | 1.235 |
    """
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(format_cell(row[c]) for c in columns) + " |"
                    for row in rows]


def write_result(stem: str | os.PathLike, title: str, columns: Sequence[str], rows: list[dict],
                 verdict: str, *, extra: dict | None = None, note: str = "") -> dict:
    """Write ``<stem>.json`` and the note ``<stem>.md``; print the table and the verdict.

    Args:
        stem: path without suffix, e.g. ``docs/results/llm_balora``.
        title: the note's heading.
        columns: the table's columns, in order; rows: one dict per row keyed by them.
        verdict: one paragraph, the reading of the table against the claim.
        extra: more JSON fields (arguments, raw runs, timings).
        note: Markdown appended after the verdict (e.g. an image link).

    Returns:
        The JSON payload.

    Example::

        >>> import tempfile, pathlib
        >>> stem = pathlib.Path(tempfile.mkdtemp()) / "demo"
        >>> _ = write_result(stem, "Demo", ["arm"], [{"arm": "lora"}], "Fine.")
        | arm |
        |---|
        | lora |
        <BLANKLINE>
        **Verdict.** Fine.
        <BLANKLINE>
        written ...demo.json
        >>> sorted(p.suffix for p in stem.parent.iterdir())
        ['.json', '.md']
    """
    stem = pathlib.Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    payload = {"title": title, "date": datetime.date.today().isoformat(),
               "machine": machine_line(), "command": run_command().strip(),
               "columns": list(columns), "rows": rows, "verdict": verdict, **(extra or {})}
    json_path = stem.with_name(stem.name + ".json")
    json_path.write_text(json.dumps(payload, indent=1, default=float))
    lines = [f"# {title}", "", f"`{payload['command']}` — {payload['date']}, {payload['machine']}",
             "", *markdown_table(columns, rows), "", f"**Verdict.** {verdict}", ""]
    if note:
        lines += [note, ""]
    stem.with_name(stem.name + ".md").write_text("\n".join(lines))
    print("\n".join(lines[4:]))
    print(f"written {json_path}")
    return payload


class RunCache:
    """Finished runs of a long reproduction, kept in one JSON file so a rerun resumes.

    The file holds ``{"settings": ..., "runs": {key: result}}``; a cache whose settings differ
    from ``settings`` (another protocol) is started afresh. :meth:`get` returns a stored run or
    computes it and writes the file at once, so a stopped command keeps what it finished.

    Example::

        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "runs.json"
        >>> RunCache(path, {"steps": 2}).get("lora/0", lambda: {"final": 1.5})
        {'final': 1.5}
        >>> RunCache(path, {"steps": 2}).get("lora/0", lambda: 1 / 0)  # reused, not recomputed
        {'final': 1.5}
        >>> RunCache(path, {"steps": 3}).runs
        {}
    """

    def __init__(self, path: str | os.PathLike, settings: dict):
        self.path = pathlib.Path(path)
        saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        if saved.get("settings") != settings:
            saved = {"settings": settings, "runs": {}}
        self.payload = saved

    @property
    def runs(self) -> dict:
        """``{key: result}`` of the stored runs."""
        return self.payload["runs"]

    def get(self, key: str, run, *, announce: bool = False):
        """The stored result of ``key``, or ``run()`` (stored and written); ``announce`` prints
        a line when a stored result is reused."""
        if key not in self.runs:
            self.runs[key] = run()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # atomic: a run stopped while writing keeps the cache it had, not half a file
            atomic_write_text(self.path, json.dumps(self.payload, default=float))
        elif announce:
            print(f"  {key}: reused from {self.path}")
        return self.runs[key]


class RecordFolder:
    """One JSON record per key in a folder, each tagged with the protocol that produced it.

    For a reproduction whose parts run in separate processes (one method per command): each part
    writes ``<folder>/<key>.json`` = ``{"fingerprint": ..., **record}`` atomically, and
    :meth:`read` returns a stored record only when its fingerprint equals this one (another
    protocol's record reads as missing), so the table merges only comparable rows.

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> RecordFolder(folder, {"layers": 4}).write("rtn", rows=[{"ppl": 9.5}])
        >>> RecordFolder(folder, {"layers": 4}).read("rtn")["rows"]
        [{'ppl': 9.5}]
        >>> RecordFolder(folder, {"layers": 30}).read("rtn") is None
        True
    """

    def __init__(self, folder: str | os.PathLike, fingerprint: dict):
        self.folder = pathlib.Path(folder)
        self.fingerprint = fingerprint

    def write(self, key: str, **record) -> None:
        """Store ``record`` (JSON-able keyword fields) under ``key``, with the fingerprint."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.folder / f"{key}.json", json.dumps(
            {"fingerprint": self.fingerprint, **record}, indent=1))

    def read(self, key: str) -> dict | None:
        """The record stored under ``key`` by the same protocol, or ``None``."""
        path = self.folder / f"{key}.json"
        if not path.is_file():
            return None
        saved = json.loads(path.read_text())
        return saved if saved.get("fingerprint") == self.fingerprint else None


__all__ = ["RecordFolder", "RunCache", "format_cell", "machine_line", "markdown_table",
           "run_command", "write_result"]
