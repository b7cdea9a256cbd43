"""Checks of user input made before any work: CLI numbers, regexes, text files, jobs files.

Each check raises a ``ValueError`` (or, for argparse types, ``argparse.ArgumentTypeError``)
whose one-line message names the argument, what was wrong and how to fix it.

Example::

    >>> positive_int("3")
    3
    >>> check_regex(r"(q|v)_proj", "--targets").pattern
    '(q|v)_proj'
"""

from __future__ import annotations

import argparse
import math
import os
import re

from lowrank_jax.runs.outputs import inside


def _number(text: str, kind):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        name = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer (>= 1)")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= 0")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (learning rates: a negative one ascends the loss)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def check_regex(pattern: str | None, argument: str):
    """Compile ``pattern`` (``None`` passes through) or say which argument is not a regex."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{argument} {pattern!r} is not a valid regular expression ({error}); "
                         r"escape special characters with a backslash, e.g. '\('.") from None


def check_text_file(path: str | None, argument: str) -> str | None:
    """Check that ``path`` is a readable UTF-8 text file; returns its text (``None`` passes)."""
    if path is None:
        return None
    if not os.path.exists(path):
        raise ValueError(f"{argument} {path}: file not found; pass a UTF-8 text file.")
    if os.path.isdir(path):
        raise ValueError(f"{argument} {path}: is a folder; pass a UTF-8 text file.")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise ValueError(f"{argument} {path}: cannot read it ({error.strerror}).") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{argument} {path}: not UTF-8 text (byte {data[error.start]:#04x} at offset "
            f"{error.start}); convert it, e.g. iconv -f latin1 -t utf-8.") from None


def read_yaml_mapping(path: str, argument: str) -> dict:
    """Read a YAML file that must hold a mapping; parse errors name the file and the line."""
    import yaml

    text = check_text_file(path, argument)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{argument} {path}: invalid YAML{where} ({problem}).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):  # a user's file, not a programming error: ValueError
        kind = type(data).__name__
        raise ValueError(f"{argument} {path}: expected a mapping (key: value lines), got a "
                         f"{kind}.")
    return data


def check_jobs_file(path: str, out: str, argument: str = "jobs file") -> tuple[dict, str]:
    """Validate a jobs file (``lowrank-jax jobs``) before any work: its YAML, its numbers, its
    job names (each job writes ``out/<name>``, so a name must stay inside ``out``) and data
    files. Messages start with ``argument`` (``"--jobs"``, ``"jobs file"``) and the path.

    Returns:
        ``(spec, out)``: the parsed spec and the output folder it writes to.
    """
    spec = read_yaml_mapping(path, argument)
    out = spec.get("out", out)
    for key in ("steps", "seq_len"):
        value = spec.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{argument} {path}: {key}={value!r} must be a positive integer.")
    jobs = spec.get("jobs") or []
    if not isinstance(jobs, list) or not all(isinstance(j, dict) for j in jobs):
        raise ValueError(f"{argument} {path}: 'jobs' must be a list of mappings, e.g. "
                         "jobs: [{name: small, rank: 4}].")
    for i, job in enumerate(jobs):
        name = str(job.get("name", f"job{i}"))
        inside(out, name, argument=f"{argument} {path}: job {i} name")
        for key in ("lr", "alpha", "clip", "weight_decay"):
            if key in job:
                value = job[key]
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"{argument} {path}: job {name!r} {key}={job[key]!r} must be "
                                     "a number.") from None
                if key == "lr" and not value > 0:
                    raise ValueError(f"{argument} {path}: job {name!r} lr={job[key]} must be > 0.")
                if key != "lr" and value < 0:
                    raise ValueError(f"{argument} {path}: job {name!r} {key}={job[key]} must be "
                                     ">= 0.")
        if job.get("data"):
            check_text_file(job["data"], f"{argument} {path}: job {name!r} data")
    return spec, out


__all__ = ["check_jobs_file", "check_regex", "check_text_file", "non_negative_float",
           "non_negative_int", "positive_float", "positive_int", "read_yaml_mapping"]
