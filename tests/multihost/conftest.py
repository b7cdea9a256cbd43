"""Shared fixtures of the multi-process tests."""

import threading

import pytest


class Lines:
    """A thread-safe sink for the launcher's prefixed output (its reader threads write here)."""

    def __init__(self):
        self.lines, self.lock = [], threading.Lock()

    def write(self, text):
        with self.lock:
            self.lines.append(text)

    def flush(self):
        pass

    def text(self):
        with self.lock:
            return "".join(self.lines)


@pytest.fixture
def launcher_output():
    """Make a fresh output sink for :func:`lowrank_jax.train.multihost.launch` (``out=``)."""
    return Lines
