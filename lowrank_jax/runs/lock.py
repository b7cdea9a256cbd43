"""One process per run folder: a lock file naming the process that writes the run.

A second ``pretrain`` on a live ``run_dir`` would interleave its checkpoints and metrics with
the first one's (or, with ``--overwrite``, delete them under it). :func:`acquire` creates
``run_dir/.lowrank-jax.lock`` holding the writer's PID and host, atomically (``O_EXCL``):

- a lock of a live process (same host, PID running) is refused with one line naming the PID;
- a stale lock (its process is gone: killed, crashed, the machine rebooted) is taken over, and
  the caller is told so;
- a lock of this very process is re-entered (a command that calls the library twice).

Multi-process runs take the lock once, on process 0 (which writes every file of the run); the
other processes never touch it. :func:`release` removes a lock this process holds;
:func:`release_all` (called by the ``lowrank-jax`` entry point when a command ends) every one.

Example::

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> acquire(folder)  # a fresh folder: no note
    >>> holder(folder)["pid"] == os.getpid()
    True
    >>> release(folder)
    >>> holder(folder) is None
    True
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import socket

LOCK_NAME = ".lowrank-jax.lock"
_HELD: set[pathlib.Path] = set()


def holder(folder: str | os.PathLike) -> dict | None:
    """The lock's ``{"pid", "host"}`` in ``folder``, or ``None`` when there is none (an
    unreadable lock file reads as ``{"pid": None, ...}``: a lock being written)."""
    path = pathlib.Path(folder) / LOCK_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {"pid": None, "host": None}
    try:
        data = json.loads(text)
    except ValueError:
        return {"pid": None, "host": None}
    return data if isinstance(data, dict) else {"pid": None, "host": None}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OSError:
        return False
    with contextlib.suppress(OSError):  # a zombie (exited, not yet reaped) holds nothing
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                return False
    return True


def acquire(folder: str | os.PathLike, *, argument: str = "run_dir") -> str | None:
    """Take the lock of ``folder`` (which must exist) for this process.

    Args:
        folder: the run folder.
        argument: how the user gave the folder, for the message.

    Returns:
        ``None``, or a note to show the user when a stale lock was taken over.

    Raises:
        ValueError: another live process on this host holds the lock (the message names its
            PID), or a process on another host does (a run folder on a shared disk).
    """
    folder = pathlib.Path(folder)
    path = folder / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    note = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = holder(folder) or {}
            pid, host = owner.get("pid"), owner.get("host")
            if pid == me["pid"] and host == me["host"]:
                _HELD.add(folder.resolve())
                return note
            if host not in (None, me["host"]):
                raise ValueError(
                    f"{argument} {folder}: the run is in use by process {pid} on host {host} "
                    f"({path}); wait for it to finish, or delete {path} if that process is "
                    "gone.") from None
            if pid is not None and _alive(pid):
                raise ValueError(
                    f"{argument} {folder}: the run is in use by another lowrank-jax process "
                    f"(PID {pid}); wait for it to finish or stop it (kill {pid}), or choose "
                    "another folder.") from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            note = (f"{argument} {folder}: took over the lock of process {pid}, which is no "
                    "longer running")
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
        _HELD.add(folder.resolve())
        return note
    raise ValueError(f"{argument} {folder}: could not take the run lock {path} (another process "
                     "keeps taking it); make sure only one run uses this folder.")


def release(folder: str | os.PathLike) -> None:
    """Remove the lock of ``folder`` if this process holds it (never raises)."""
    folder = pathlib.Path(folder)
    _HELD.discard(folder.resolve())
    owner = holder(folder)
    if owner is not None and owner.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            (folder / LOCK_NAME).unlink()


def release_all() -> None:
    """Release every lock this process holds."""
    for folder in list(_HELD):
        release(folder)


def releasing(fn):
    """Decorate ``fn`` so that the locks it takes are released when it returns or raises
    (a library function such as :func:`lowrank_jax.train.train` holds its run's lock only
    while it runs).

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> releasing(acquire)(folder)
        >>> holder(folder) is None
        True
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_HELD)
        try:
            return fn(*args, **kwargs)
        finally:
            for folder in set(_HELD) - before:
                release(folder)

    return wrapper


__all__ = ["LOCK_NAME", "acquire", "holder", "release", "release_all", "releasing"]
