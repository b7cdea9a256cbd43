"""Output folders that never lose a user's work: checked before any work, written atomically.

Every command that writes calls :func:`prepare_output` at its start, before loading a model or
training, so a bad target fails in a second instead of after an hour:

- the target must be (or become) a folder we can write (its parent exists or can be made, a
  file is not in the way, a probe file can be created);
- a folder that is not empty and was not created by ``lowrank-jax`` is refused, and so is one
  holding another run, unless ``overwrite`` (replace) or ``resume`` (continue) says otherwise;
- the folder gets a small marker file (:data:`MARKER`) naming the command that owns it, and
  that kind never changes: a folder of another command is refused even with ``overwrite``;
- the folder is never one the command reads from (``reads``): an output equal to, inside or
  containing an input (``--out RUN`` with ``--run RUN``) is refused, with or without
  ``overwrite`` (:func:`check_not_input`).

Files are written with :func:`atomic_write_text` / :func:`staged_folder` (temporary name, then a
rename), and paths built from user-given names go through :func:`inside`, which refuses
anything that would land outside the output folder (``../x``, absolute names).

Example::

    >>> import tempfile, os
    >>> out = prepare_output(os.path.join(tempfile.mkdtemp(), "run"), command="finetune")
    >>> atomic_write_text(inside(out, "summary.json"), "{}")
    >>> sorted(os.listdir(out))
    ['.lowrank-jax.json', 'summary.json']
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import tempfile

from lowrank_jax.runs import lock as run_lock

MARKER = ".lowrank-jax.json"
_BOOKKEEPING = (MARKER, run_lock.LOCK_NAME)  # our files in an output folder, not its content
_CREATED: list[pathlib.Path] = []  # folders prepare_output made in this process


def _listing(folder: pathlib.Path, limit: int = 4) -> str:
    names = sorted(p.name for p in folder.iterdir() if p.name not in _BOOKKEEPING)
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return shown


def _owner(folder: pathlib.Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _kind(folder: pathlib.Path) -> str | None:
    """The command that made ``folder``: its marker, or ``pretrain`` for a run made before
    markers (a ``checkpoints/`` folder of numbered steps)."""
    owner = _owner(folder)
    if isinstance(owner, dict) and isinstance(owner.get("command"), str):
        return owner["command"]
    steps = folder / "checkpoints"
    if steps.is_dir() and any(p.name.isdigit() for p in steps.iterdir()):
        return "pretrain"
    return None


def _resolved(path: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(os.path.abspath(os.path.realpath(os.path.expanduser(str(path)))))


def check_not_input(out: str | os.PathLike | None, reads: dict, *,
                    argument: str = "--out") -> None:
    """Refuse an output path that is, lies inside or contains a path the command reads.

    Args:
        out: the output folder (or file) the command writes.
        reads: ``{argument: path}`` of the command's inputs (``{"--run": "runs/a"}``); ``None``
            and names that are not on disk (a preset such as ``tiny``) are skipped.
        argument: how the user gave ``out``, for the message.

    Raises:
        ValueError: one line naming both paths; ``--overwrite`` does not lift it (writing there
            would destroy what is being read).

    Example::

        >>> check_not_input("runs/b", {"--run": "runs/a"})  # disjoint: fine
    """
    if out is None or str(out).strip() == "":
        return
    target = _resolved(out)
    for name, path in reads.items():
        if path is None or str(path).strip() == "" or not os.path.exists(str(path)):
            continue
        source = _resolved(path)
        if source == target:
            relation = "is"
        elif source in target.parents:
            relation = "lies inside"
        elif target in source.parents:
            relation = "contains"
        else:
            continue
        raise ValueError(
            f"{argument} {out} {relation} {name} {path}: a command never writes into what it "
            f"reads (not even with `overwrite`); choose a separate {argument}, e.g. "
            f"{source.parent / (source.stem + '-out')}.")


def check_writable(path: str | os.PathLike, argument: str) -> pathlib.Path:
    """Check (without creating anything) that ``path`` can become a folder we write into.

    Raises:
        ValueError: naming ``argument`` when a file is in the way, the path is empty, or the
            nearest existing parent folder cannot be written.
    """
    if path is None or str(path).strip() == "":
        raise ValueError(f"{argument} is empty; give an output folder, e.g. "
                         f"{argument} runs/my_run.")
    target = pathlib.Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{argument} {path}: is a file, not a folder; remove it or choose "
                         "another folder.")
    probe_dir = target
    while not probe_dir.exists():
        if probe_dir.parent == probe_dir:
            break
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise ValueError(f"{argument} {path}: {probe_dir} is a file, so no folder can be made "
                         "under it; choose another path.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise ValueError(f"{argument} {path}: cannot write in {probe_dir} ({reason.lower()}); "
                         "choose a folder you can write to.") from None
    return target


def prepare_output(path: str | os.PathLike, *, command: str, argument: str = "--out",
                   overwrite: bool = False, resume: bool = False,
                   owned_names: tuple[str, ...] = (), reads: dict | None = None,
                   lock: bool = False, log=None) -> pathlib.Path:
    """Check and claim the output folder ``path`` before any work starts.

    Args:
        path: the output folder.
        command: the command that owns it (``"pretrain"``, ``"finetune"``, ...), recorded in
            the marker file.
        argument: how the user gave the path (``"--out"``, ``"run_dir"``), for messages.
        overwrite: write into the folder even though it is not empty or holds another run
            (``--overwrite``); the names in ``owned_names`` are removed first, every other
            file is kept (files of the same name are replaced when written).
        resume: continue a run of the same command in this folder (``--resume``).
        owned_names: stale outputs of ``command`` removed by ``overwrite`` (e.g. the
            checkpoints of a previous run, which would otherwise be resumed).
        reads: ``{argument: path}`` of what the command reads; ``path`` may not be, contain or
            lie inside the output (see :func:`check_not_input`).
        lock: take the folder's run lock (:mod:`lowrank_jax.runs.lock`) before anything in it
            is removed: a folder in use by another live process is refused, even with
            ``overwrite``; a stale lock is taken over (``log`` gets a note). Release it with
            :func:`lowrank_jax.runs.lock.release`.
        log: where the note of a taken-over lock goes (default: nowhere).

    Returns:
        The folder, created, with its marker. A folder this call created that still holds
        nothing but the marker when the command fails is removed by :func:`discard_unused`.

    Raises:
        ValueError: the folder is not writable, not empty and not ours, holds another run, is
            a folder of another command (even with ``overwrite``), is one of ``reads``, or
            (``lock``) is in use by another process.
    """
    check_not_input(path, reads or {}, argument=argument)
    target = check_writable(path, argument)
    kind = _kind(target) if target.is_dir() else None
    if kind is not None and kind != command:
        raise ValueError(
            f"{argument} {path}: the folder holds a {kind} run; choose another folder for "
            f"{command} (a folder's kind never changes, not even with `overwrite`).")
    if not target.exists():
        _CREATED.append(_resolved(target))
    if lock:
        target.mkdir(parents=True, exist_ok=True)
        note = run_lock.acquire(target, argument=argument)
        if note and log is not None:
            log(note)
    try:
        _claim(target, path, command=command, argument=argument, overwrite=overwrite,
               resume=resume, owned_names=owned_names)
    except BaseException:
        if lock:
            run_lock.release(target)
        discard_unused()
        raise
    return target


def _claim(target: pathlib.Path, path, *, command, argument, overwrite, resume, owned_names):
    """The content checks of :func:`prepare_output` (the lock, if any, is held)."""
    if target.is_dir() and any(p.name not in _BOOKKEEPING for p in target.iterdir()):
        owner = _owner(target)
        contents = _listing(target)
        steps = target / "checkpoints"
        has_steps = steps.is_dir() and any(p.name.isdigit() for p in steps.iterdir())
        if overwrite:
            for name in owned_names:
                victim = target / name
                if victim.is_dir() and not victim.is_symlink():
                    shutil.rmtree(victim)
                elif victim.exists() or victim.is_symlink():
                    victim.unlink()
        elif owner is None and not (resume and steps.is_dir()):
            raise ValueError(
                f"{argument} {path}: the folder is not empty ({contents}) and was not created "
                f"by lowrank-jax; choose an empty or new folder, or pass `overwrite` to "
                "write into it anyway.")
        elif not resume and command == "pretrain" and not has_steps:
            raise ValueError(
                f"{argument} {path}: the folder holds a pretrain run that stopped before its "
                f"first checkpoint ({contents}), so there is nothing to resume; pass "
                "`overwrite` to start it again, or choose another folder.")
        elif not resume:
            hint = "pass `resume` to continue it, " if command == "pretrain" else ""
            raise ValueError(
                f"{argument} {path}: the folder already holds a {command} run ({contents}); "
                f"{hint}pass `overwrite` to replace it, or choose another folder.")
    target.mkdir(parents=True, exist_ok=True)
    if _owner(target) is None or overwrite:
        atomic_write_text(target / MARKER, json.dumps({"command": command}) + "\n")


def discard_unused() -> list[pathlib.Path]:
    """Remove the folders :func:`prepare_output` created in this process that still hold
    nothing but the marker (a command that failed after claiming its output, e.g. on a bad
    argument, leaves no empty output folder behind). Returns the removed folders.

    Example::

        >>> import tempfile
        >>> out = prepare_output(os.path.join(tempfile.mkdtemp(), "new"), command="analyze")
        >>> discard_unused() == [out.resolve()], out.exists()
        (True, False)
    """
    removed = []
    while _CREATED:
        folder = _CREATED.pop()
        with contextlib.suppress(OSError):
            if folder.is_dir() and all(p.name in _BOOKKEEPING for p in folder.iterdir()):
                owner = run_lock.holder(folder)
                if owner is not None and owner.get("pid") != os.getpid():
                    continue  # another process took it meanwhile
                run_lock.release(folder)
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


def forget_created() -> None:
    """Keep the folders made so far (the command succeeded): :func:`discard_unused` will not
    remove them."""
    _CREATED.clear()


def inside(folder: str | os.PathLike, name: str, *, argument: str = "name") -> pathlib.Path:
    """``folder / name``, refusing a ``name`` that would leave ``folder`` (``../x``, ``/x``).

    Example::

        >>> inside("runs/jobs", "small").as_posix()
        'runs/jobs/small'
    """
    text = str(name)
    parts = pathlib.PurePath(text).parts
    if (not text.strip() or pathlib.PurePath(text).is_absolute() or ".." in parts
            or text.startswith("~")):
        raise ValueError(f"{argument}={text!r} would write outside {folder}; use a plain name "
                         "such as 'small' (letters, digits, '-', '_').")
    return pathlib.Path(folder) / text


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half a file)."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_folder(path: str | os.PathLike):
    """Yield a temporary folder next to ``path``; on success it becomes ``path`` by a rename.

    When ``path`` already exists, each staged file replaces its namesake by a rename and any
    other file in ``path`` is kept. On an error the temporary folder is removed and ``path`` is
    left as it was.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if path.is_dir():
            for entry in tmp.iterdir():
                os.replace(entry, path / entry.name)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe_os_error(error: OSError) -> str:
    """One line for an ``OSError`` (naming the file, the reason and a fix)."""
    if error.errno is None or not error.strerror:
        return str(error.args[0]) if error.args else type(error).__name__
    where = f"{error.filename}: " if error.filename else ""
    fixes = {
        errno.ENOSPC: "free disk space or choose a folder on another disk",
        errno.EACCES: "choose a path you can write to or fix its permissions",
        errno.EPERM: "choose a path you can write to or fix its permissions",
        errno.EROFS: "the file system is read-only; choose a writable folder",
        errno.EISDIR: "give a file, not a folder",
        errno.ENOTDIR: "a file is in the way of that folder path; choose another path",
        errno.ENOENT: "check the path",
        errno.EEXIST: "remove it or choose another name",
    }
    fix = fixes.get(error.errno, "check the path and try again")
    return f"{where}{error.strerror.lower()}; {fix}."


# how libraries that do not raise OSError (safetensors' Rust IoError, TensorStore) spell one
_OS_ERROR_TEXTS = (
    ("no space left on device", errno.ENOSPC), ("storagefull", errno.ENOSPC),
    ("os error 28", errno.ENOSPC), ("disk quota exceeded", errno.EDQUOT),
    ("input/output error", errno.EIO), ("os error 5)", errno.EIO),
    ("read-only file system", errno.EROFS), ("permission denied", errno.EACCES),
)


def os_error_of(error: BaseException) -> OSError | None:
    """The I/O fault behind ``error``, as an ``OSError``: ``error`` itself, an ``OSError`` in
    its ``__cause__`` / ``__context__`` chain, or a library error whose text names one (a full
    disk reported by safetensors as ``SafetensorError: ... No space left on device``);
    ``None`` when it is not an I/O fault.

    Example::

        >>> os_error_of(RuntimeError("IoError(Os { code: 28, kind: StorageFull })")).errno == 28
        True
        >>> os_error_of(RuntimeError("a bug")) is None
        True
    """
    seen = set()
    current = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        text = str(current).lower()
        for needle, code in _OS_ERROR_TEXTS:
            if needle in text:
                where = getattr(current, "filename", None)
                return OSError(code, os.strerror(code), where) if where else \
                    OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


__all__ = ["MARKER", "atomic_write_text", "check_not_input", "check_writable",
           "describe_os_error", "discard_unused", "forget_created", "inside", "os_error_of",
           "prepare_output", "staged_folder"]
