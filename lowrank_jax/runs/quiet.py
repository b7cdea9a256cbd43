"""Keep the libraries' background noise off the terminal: their detail goes to the run's log.

orbax, TensorStore, absl, JAX and asyncio report what they do (and, after a damaged checkpoint
or a full disk, long tracebacks, TensorStore specs and ``Exception ignored in: <coroutine>``
lines at shutdown) on stderr. A user who met a fault that the command handled needs one clear
line, not thousands. Inside :func:`quiet_libraries` (the ``lowrank-jax`` command runs in it
unless ``--debug``):

- the log records of those libraries (and Python warnings) are appended to
  :data:`LOG_NAME` in the run folders registered with :func:`log_to` (a pretraining run
  registers its ``run_dir``), and are kept off stderr;
- exceptions Python cannot raise (``sys.unraisablehook``: a coroutine collected after its
  event loop closed, a failing ``__del__``) are written there too.

Our own messages (``print`` to stdout / stderr) are unaffected.

Example::

    >>> import logging, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> with quiet_libraries():
    ...     log_to(folder)
    ...     logging.getLogger("absl").warning("orbax detail")
    >>> "orbax detail" in (folder / LOG_NAME).read_text()
    True
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import traceback
import warnings

LOG_NAME = "lowrank-jax.log"
# the loggers whose records are detail, not messages for the user
LIBRARY_LOGGERS = ("absl", "orbax", "jax", "jaxlib", "tensorstore", "asyncio", "etils",
                   "concurrent")

_folders: list[pathlib.Path] = []
_active = [False]


def log_to(folder: str | os.PathLike) -> None:
    """Append the libraries' detail to ``folder/lowrank-jax.log`` from now on (inside
    :func:`quiet_libraries`; elsewhere the libraries print as usual and this does nothing).
    What was recorded before any folder was registered is dropped."""
    folder = pathlib.Path(folder).absolute()
    if _active[0] and folder not in _folders:
        _folders.append(folder)


def record(text: str) -> None:
    """Append ``text`` to the registered log files (never raises: a full disk is the likely
    reason something is being logged)."""
    text = text.rstrip("\n") + "\n"
    for folder in _folders:
        with contextlib.suppress(OSError, ValueError):
            if folder.is_dir():
                with open(folder / LOG_NAME, "a", encoding="utf-8") as f:
                    f.write(text)


class _Handler(logging.Handler):
    def emit(self, rec: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            record(self.format(rec))


def _unraisable(info) -> None:
    with contextlib.suppress(Exception):
        lines = traceback.format_exception(info.exc_type, info.exc_value, info.exc_traceback)
        where = f"Exception ignored in: {info.object!r}\n" if info.object is not None else ""
        record(where + "".join(lines))


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    record(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def quiet_libraries(*, level: int = logging.WARNING, keep_after: bool = False):
    """Route the libraries' log records, warnings and unraisable exceptions to the run log.

    Args:
        level: the least severe record kept in the log file.
        keep_after: leave the unraisable-exception hook (and the logger routing) in place after
            the block, for the noise of an interpreter shutting down (the command-line entry
            point; in-process callers restore everything).
    """
    handler = _Handler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    saved = []
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers), logger.level, logger.propagate))
        logger.handlers = [handler]
        logger.setLevel(level)
        logger.propagate = False
    absl_verbosity = None
    with contextlib.suppress(Exception):
        from absl import logging as absl_logging

        absl_verbosity = absl_logging.get_verbosity()
        absl_logging.set_verbosity(absl_logging.WARNING)
    previous_hook, previous_show = sys.unraisablehook, warnings.showwarning
    sys.unraisablehook, warnings.showwarning = _unraisable, _showwarning
    _folders.clear()
    _active[0] = True
    try:
        yield
    finally:
        if not keep_after:
            sys.unraisablehook, warnings.showwarning = previous_hook, previous_show
            for logger, handlers, old_level, propagate in saved:
                logger.handlers, logger.propagate = handlers, propagate
                logger.setLevel(old_level)
            if absl_verbosity is not None:
                with contextlib.suppress(Exception):
                    from absl import logging as absl_logging

                    absl_logging.set_verbosity(absl_verbosity)
            _folders.clear()
            _active[0] = False


__all__ = ["LIBRARY_LOGGERS", "LOG_NAME", "log_to", "quiet_libraries", "record"]
