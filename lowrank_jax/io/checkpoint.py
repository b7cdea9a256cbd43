"""Orbax checkpoints of a training run that are verified before they are trusted.

At save, next to orbax's files, each step folder gets :data:`INTEGRITY_NAME`: a SHA-256 of
every saved array and a fingerprint of what the arrays mean (the architecture and the
optimizer). At restore, steps are tried newest first; a step whose orbax files are damaged
(missing ``_METADATA`` / ``default/`` / data files, truncated files) or whose restored arrays do
not match their checksums (flipped bytes) is moved aside to ``corrupt_checkpoints/`` and the
next older step is used::

    step 10 is corrupt (checksum mismatch in params/embed_tokens/embedding); resuming from step 5

A checkpoint saved with another architecture or optimizer is not "corrupt": resuming it is
refused with one line naming what differs. Saves are shielded from a second Ctrl-C / SIGTERM
(:func:`shield_interrupts`), and :func:`truncate_metrics` drops the ``metrics.jsonl`` rows
written after the restored step, so a resumed run's metrics have no duplicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import shutil
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lowrank_jax.runs import quiet
from lowrank_jax.runs.outputs import atomic_write_text

INTEGRITY_NAME = "lowrank_jax_integrity.json"
CORRUPT_DIR = "corrupt_checkpoints"
# LlamaConfig fields that change the saved arrays (attention / compute dtype do not)
_STATELESS_MODEL_FIELDS = ("attention", "dtype")


_OPEN: weakref.WeakSet = weakref.WeakSet()  # managers not closed yet (close_managers)


DATA_ITEM = "data_iterator"  # the grain iterator's item in a step (one JSON file per process)


def checkpoint_manager(run_dir: pathlib.Path, *, create: bool = True,
                       data_iterator: bool = False):
    """The run's orbax manager over ``run_dir/checkpoints`` (the last two steps are kept).

    ``data_iterator=True`` (a run on ``--data``): each step holds the state arrays (item
    ``default``) and the data iterator (item :data:`DATA_ITEM`, grain's checkpoint handler: one
    ``process_I-of-N.json`` per process), committed together.

    ``create=True`` (a run that writes): the libraries' detail (orbax / TensorStore log records,
    see :mod:`lowrank_jax.runs.quiet`) goes to ``run_dir/lowrank-jax.log``. Every manager made
    here is closed by :func:`close_managers` (the ``lowrank-jax`` command calls it on every
    path, so no background thread or event loop outlives the command).
    """
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=create)
    items = {"item_names": ("default", DATA_ITEM)} if data_iterator else {}
    manager = ocp.CheckpointManager((pathlib.Path(run_dir) / "checkpoints").absolute(),
                                    options=options, **items)
    if create:
        quiet.log_to(run_dir)
    _OPEN.add(manager)
    return manager


def close_manager(manager) -> None:
    """Close ``manager`` (waiting for its saves), never raising: it runs on error paths, where
    the disk that failed the save may fail the close too (the detail goes to the run log)."""
    try:
        manager.close()
    except Exception as error:  # noqa: BLE001
        quiet.record(f"closing the checkpoint manager of {manager.directory}: {error!r}")
    _OPEN.discard(manager)


def close_managers() -> None:
    """Close every manager made by :func:`checkpoint_manager` and not closed yet."""
    for manager in list(_OPEN):
        close_manager(manager)


def fingerprint(cfg) -> dict[str, Any]:
    """What a checkpoint's arrays mean: the architecture and the optimizer of ``cfg``."""
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items()
             if k not in _STATELESS_MODEL_FIELDS}
    out = {"model": json.loads(json.dumps(model, default=str)),
           "optimizer": {"name": cfg.optimizer.name}}
    if getattr(cfg, "structure", "none") != "none":  # absent = none: older runs stay resumable
        out["structure"] = cfg.structure
    data = getattr(cfg, "data", None)
    if data is not None and data.path is not None:  # absent = the embedded corpus
        out["data"] = {"tokenizer": data.tokenizer, "text_field": data.text_field}
    return out


def _leaves(tree) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf)
            for path, leaf in flat]


def _digest(leaf) -> str | None:
    if isinstance(leaf, jax.Array):
        if not leaf.is_fully_addressable:
            return None  # multi-host: each host holds a part; orbax checks its own files
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
    array = np.ascontiguousarray(np.asarray(leaf))
    return hashlib.sha256(str(array.dtype).encode() + str(array.shape).encode()
                          + array.tobytes()).hexdigest()


def checksums(tree) -> dict[str, str | None]:
    """``{leaf path: sha256}`` of every array of ``tree``."""
    return {path: _digest(leaf) for path, leaf in _leaves(tree)}


def _step_dir(manager, step: int) -> pathlib.Path:
    return pathlib.Path(str(manager.directory)) / str(step)


@contextlib.contextmanager
def shield_interrupts():
    """Hold SIGINT / SIGTERM back inside the block (a Ctrl-C must not cut a save short).

    Yields a list that receives the signals that arrived; the caller acts on them once the
    block is done (:func:`save_checkpoint` then raises ``KeyboardInterrupt``).
    """
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield pending
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def save_checkpoint(manager, state, cfg=None, data_iterator=None) -> None:
    """Save ``state`` (params + optimizer state) at ``state.step``, then its integrity file.

    ``data_iterator`` (a grain ``DatasetIterator`` positioned after ``state.step`` batches, on a
    manager made with ``data_iterator=True``) is saved in the same step.

    A Ctrl-C / SIGTERM arriving during the save waits until the step is complete on disk,
    then goes to its handler (Ctrl-C: ``KeyboardInterrupt``; the SIGTERM handler of
    :mod:`lowrank_jax.runs.signals`: a stop at the next step boundary).

    Raises:
        OSError: the disk is full or the folder is not writable; the message names the step
            and the folder and says that older checkpoints are intact.
    """
    if int(state.step) in manager.all_steps():
        return  # already on disk (e.g. Ctrl-C during the periodic save of this very step)
    tree = {"params": state.params, "opt_state": state.opt_state}
    with shield_interrupts() as pending:
        try:
            if data_iterator is None:
                manager.save(state.step, args=ocp.args.StandardSave(tree))
            else:
                import grain.checkpoint

                manager.save(state.step, args=ocp.args.Composite(
                    default=ocp.args.StandardSave(tree),
                    **{DATA_ITEM: grain.checkpoint.CheckpointSave(data_iterator)}))
            manager.wait_until_finished()
            record = {"format": 1, "step": int(state.step), "checksums": checksums(tree),
                      "fingerprint": fingerprint(cfg) if cfg is not None else None}
            if jax.process_index() == 0:  # one writer; orbax wrote every process's shards
                atomic_write_text(_step_dir(manager, state.step) / INTEGRITY_NAME,
                                  json.dumps(record, indent=1))
        except Exception as error:  # orbax/tensorstore wrap OS errors
            quiet.record(f"saving step {int(state.step)} failed: {error!r}")
            raise _save_error(error, manager, state.step) from error
    for signum in pending:  # now to the handlers the caller installed (SIGTERM: a request)
        handler = signal.getsignal(signum)
        if not callable(handler):
            raise KeyboardInterrupt
        handler(signum, None)


def _save_error(error: Exception, manager, step: int) -> OSError:
    text = str(error)
    code = getattr(error, "errno", None)
    if code is None:
        code = errno.ENOSPC if "No space left" in text else errno.EIO
    reason = os.strerror(code).lower()
    try:
        older = [s for s in manager.all_steps() if s < step]
    except Exception:  # noqa: BLE001 - the listing may fail on the same broken disk
        older = []
    kept = (f"step {max(older)} is intact; continue with `resume`" if older
            else "no older checkpoint exists")
    fix = ("free disk space or choose another run_dir" if code == errno.ENOSPC
           else "check the run_dir's disk and permissions")
    saved = OSError(f"cannot save checkpoint step {step} in {manager.directory}: {reason} "
                    f"({kept}); {fix}.")
    return saved


def _short(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def _read_integrity(step_dir: pathlib.Path) -> dict | None:
    path = step_dir / INTEGRITY_NAME
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise _CorruptStep(f"{INTEGRITY_NAME} is unreadable: {_short(error)}") from None
    if not isinstance(record, dict) or not isinstance(record.get("checksums"), dict):
        raise _CorruptStep(f"{INTEGRITY_NAME} has no checksums")
    return record


class _CorruptStep(Exception):
    pass


def _differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {a} -> {b}")
    return out


def _check_compatible(record: dict, step: int, cfg, run_dir) -> None:
    saved = record.get("fingerprint")
    if cfg is None or saved is None:
        return
    diff = _differences(saved, fingerprint(cfg))
    if diff:
        raise ValueError(
            f"`resume`: the checkpoint (step {step}) in {run_dir} was saved with a different "
            f"configuration: {', '.join(diff)}; resume with the configuration it was saved "
            "with, or start a new run (another run_dir).")


def _check_data_item(step_dir: pathlib.Path, step: int) -> None:
    """The step holds this process's data iterator file, or a clear error (not corruption)."""
    folder = step_dir / DATA_ITEM
    index, count = jax.process_index(), jax.process_count()
    if (folder / f"process_{index}-of-{count}.json").exists():
        return
    saved = sorted(p.name for p in folder.glob("process_*-of-*.json")) if folder.is_dir() else []
    if not saved:
        if folder.is_dir() or not (step_dir / "default").is_dir():
            raise _CorruptStep(f"{DATA_ITEM}/ holds no iterator state")
        raise ValueError(f"`resume`: the checkpoint (step {step}) in {step_dir.parent.parent} "
                         "was saved without a data iterator (a run on the embedded corpus); "
                         "resume it without `data`, or start a new run.")
    before = saved[0].rsplit("-of-", 1)[1].removesuffix(".json")
    raise ValueError(f"`resume`: the data iterator of step {step} was saved by {before} "
                     f"process(es), this run has {count}: each process saves its own position "
                     f"in the data; resume with {before} process(es) (or start a new run).")


def _restore_step(manager, step: int, abstract, cfg, run_dir, data_iterator=None) -> Any:
    step_dir = _step_dir(manager, step)
    record = _read_integrity(step_dir)
    if record is not None:
        _check_compatible(record, step, cfg, run_dir)
    if data_iterator is not None:
        _check_data_item(step_dir, step)
    try:
        if data_iterator is None:
            restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        else:
            import grain.checkpoint

            restored = manager.restore(step, args=ocp.args.Composite(
                default=ocp.args.StandardRestore(abstract),
                **{DATA_ITEM: grain.checkpoint.CheckpointRestore(data_iterator)}))["default"]
    except ValueError as error:
        if data_iterator is not None:
            from lowrank_jax.data.packing import DataStateMismatch

            if isinstance(error, DataStateMismatch):  # the iterator refused other data / layout
                raise
        quiet.record(f"restoring step {step} failed: {error!r}")
        raise _CorruptStep(_short(error)) from None
    except Exception as error:  # noqa: BLE001 - any orbax/tensorstore failure = damaged step
        quiet.record(f"restoring step {step} failed: {error!r}")
        raise _CorruptStep(_short(error)) from None
    if record is not None:
        saved = record["checksums"]
        for path, digest in checksums(restored).items():
            if path not in saved:
                raise _CorruptStep(f"{INTEGRITY_NAME} does not list {path}")
            if saved[path] is not None and digest is not None and saved[path] != digest:
                raise _CorruptStep(f"checksum mismatch in {path}")
    return restored


def _quarantine(run_dir: pathlib.Path, step_dir: pathlib.Path) -> pathlib.Path:
    folder = run_dir / CORRUPT_DIR
    folder.mkdir(exist_ok=True)
    target, n = folder / step_dir.name, 1
    while target.exists():
        target, n = folder / f"{step_dir.name}.{n}", n + 1
    shutil.move(str(step_dir), str(target))
    return target


def restore_checkpoint(manager, state, cfg=None, *, log: Callable[[str], None] = print,
                       data_iterator=None):
    """Restore the newest good step onto ``state``'s structure and shardings.

    ``data_iterator`` (a grain ``DatasetIterator``) is set to the step's saved position; a
    checkpoint saved by another number of processes is refused with a clear error.

    Damaged steps are moved to ``run_dir/corrupt_checkpoints/`` (never deleted) and reported
    with :func:`log`; a checkpoint of another architecture / optimizer raises.

    Returns:
        ``(state, manager)``: the restored state, and a manager that no longer lists the
        moved-aside steps (use it for the next saves).

    Raises:
        FileNotFoundError: no checkpoint at all.
        ValueError: the checkpoint was saved with another configuration, or every step is
            damaged.
    """
    checkpoints = pathlib.Path(str(manager.directory))
    run_dir = checkpoints.parent
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(
            f"`resume`: no checkpoint in {checkpoints}; run without `resume` first.")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        {"params": state.params, "opt_state": state.opt_state},
    )
    bad: list[tuple[int, str]] = []
    restored, good = None, None
    for step in steps:
        try:
            restored = _restore_step(manager, step, abstract, cfg, run_dir, data_iterator)
            good = step
            break
        except _CorruptStep as error:
            bad.append((step, str(error)))
            # move it aside now: orbax infers the layout of the next steps from what it lists
            _quarantine(run_dir, _step_dir(manager, step))
            close_manager(manager)
            manager = checkpoint_manager(run_dir, create=False,
                                         data_iterator=data_iterator is not None)
    if good is None:
        close_manager(manager)
        listed = "; ".join(f"step {s}: {why}" for s, why in bad)
        raise ValueError(f"`resume`: every checkpoint in {checkpoints} is corrupt ({listed}); "
                         f"they were moved to {run_dir / CORRUPT_DIR}; start the run again "
                         "with `overwrite` instead of `resume`.")
    for step, why in bad:
        log(f"step {step} is corrupt ({why}); resuming from step {good} "
            f"(the bad step was moved to {run_dir / CORRUPT_DIR})")
    state = dataclasses.replace(state, params=restored["params"],
                                opt_state=restored["opt_state"], step=int(good))
    return state, manager


def truncate_metrics(metrics_path: pathlib.Path, step: int) -> int:
    """Drop the rows of ``metrics.jsonl`` logged after ``step`` (returns how many)."""
    metrics_path = pathlib.Path(metrics_path)
    if not metrics_path.exists():
        return 0
    kept, dropped = [], 0
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:  # a half-written last line after kill -9
            dropped += 1
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(metrics_path, "".join(f"{line}\n" for line in kept))
    return dropped


__all__ = ["CORRUPT_DIR", "DATA_ITEM", "INTEGRITY_NAME", "checkpoint_manager", "checksums",
           "close_manager", "close_managers", "fingerprint", "restore_checkpoint",
           "save_checkpoint", "shield_interrupts", "truncate_metrics"]
