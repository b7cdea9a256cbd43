"""SIGTERM as a request to stop at the next step boundary (a scheduler, a closed session).

A SIGTERM used to raise ``KeyboardInterrupt`` wherever the main thread was, which a checkpoint
save has to hold back; the run then ended as "interrupted" with exit 130 and no summary. Now:

- the first SIGTERM only sets a flag (:func:`stop_requested`); a training loop checks it at
  each step boundary, saves a checkpoint, writes its summary and raises :class:`Stopped`, which
  the ``lowrank-jax`` entry point turns into one line and exit status :data:`EXIT_STOPPED`
  (143, the shell's code for SIGTERM);
- a second SIGTERM raises ``KeyboardInterrupt`` at once (the old, forceful path; the
  watchdog of :func:`lowrank_jax.train.multihost.install_interrupt_watchdog` still bounds it).

In a multi-process run every process must stop at the same step (the checkpoint is a
collective), so :func:`stop_agreed` combines the processes' flags.

Example::

    >>> clear()
    >>> stop_requested()
    False
    >>> request_stop()
    >>> stop_requested()
    True
    >>> clear()
"""

from __future__ import annotations

import signal
import threading

EXIT_STOPPED = 143
_REQUESTED = threading.Event()


class Stopped(Exception):  # noqa: N818 - a stop on request, not an error
    """A run stopped at a step boundary after a SIGTERM (checkpoint and summary written)."""


def request_stop(signum=None, frame=None) -> None:
    """The SIGTERM handler: the first call sets the flag, a second one raises
    ``KeyboardInterrupt``."""
    if _REQUESTED.is_set() and signum is not None:
        raise KeyboardInterrupt
    _REQUESTED.set()


def stop_requested() -> bool:
    """Whether a stop was requested (this process)."""
    return _REQUESTED.is_set()


def stop_agreed() -> bool:
    """Whether any process of the run was asked to stop: a collective in a multi-process run
    (every process calls it at the same step), :func:`stop_requested` otherwise."""
    import jax

    flag = _REQUESTED.is_set()
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def clear() -> None:
    """Forget a request (a new command starts)."""
    _REQUESTED.clear()


def install() -> None:
    """Make SIGTERM call :func:`request_stop` (main thread only; elsewhere nothing)."""
    clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, request_stop)


__all__ = ["EXIT_STOPPED", "Stopped", "clear", "install", "request_stop", "stop_agreed",
           "stop_requested"]
