"""The package's one timer: warm-up calls, then the median of blocked calls; interleaved.

Benchmarks on a shared machine only compare ratios measured in the same run. To keep a load
spike from landing on one side of a comparison, :func:`time_interleaved` runs the candidates
round-robin (``a b c a b c ...``) and takes each one's median.

Example::

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((8, 8))
    >>> times = time_interleaved({"one": lambda: x @ x, "two": lambda: (x @ x) @ x}, reps=3)
    >>> sorted(times), all(t > 0 for t in times.values())
    (['one', 'two'], True)
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int (number of timed calls).")
    return value


def time_fn(fn: Callable, *args: Any, reps: int = 10, warmup: int = 3) -> float:
    """Median wall seconds of ``fn(*args)`` after ``warmup`` calls (each result blocked on).

    Example::

        >>> import jax.numpy as jnp
        >>> time_fn(lambda a: a + 1, jnp.ones(4), reps=2, warmup=1) > 0
        True
    """
    _positive("reps", reps)
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_once(fn: Callable, *args: Any) -> tuple[float, Any]:
    """``(wall seconds, result)`` of one call ``fn(*args)``, blocked on: for one-shot costs
    (loading a file, a first call that compiles) where repeating would measure something else.

    Example::

        >>> seconds, out = time_once(lambda a: a * 2, 21)
        >>> out, seconds >= 0
        (42, True)
    """
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def time_compiled(fn: Callable, *args: Any) -> tuple[Any, float]:
    """``(result, seconds)`` of one run of ``jax.jit(fn)`` compiled ahead of time for ``args``
    (compilation excluded; pass data as arguments, not closure constants, or XLA folds them).

    Example::

        >>> import jax.numpy as jnp
        >>> out, seconds = time_compiled(lambda a: a * 2, jnp.ones(3))
        >>> out.tolist(), seconds >= 0
        ([2.0, 2.0, 2.0], True)
    """
    compiled = jax.jit(fn).lower(*args).compile()
    seconds, out = time_once(compiled, *args)
    return out, seconds


def time_steps(step: Callable, state: tuple, batches: list) -> tuple[float, Any, list]:
    """``(seconds, state, losses)`` of a training loop: ``state, loss = step(*state, *batch)``
    for every batch, the first one an untimed warm-up (compilation), the rest timed as one block
    (:func:`time_once`); ``losses`` are the timed steps' losses as numpy values.

    Example::

        >>> step = lambda w, x: ((w - 0.5 * (w - x),), (w - x) ** 2)
        >>> seconds, (w,), losses = time_steps(step, (0.0,), [(4.0,), (4.0,), (4.0,)])
        >>> w, [float(x) for x in losses]
        (3.5, [4.0, 1.0])
    """
    import numpy as np

    state, loss = step(*state, *batches[0])
    jax.block_until_ready(loss)

    def run(state):
        losses = []
        for batch in batches[1:]:
            state, loss = step(*state, *batch)
            losses.append(loss)
        return state, losses

    seconds, (state, losses) = time_once(run, state)
    return seconds, state, [np.asarray(x) for x in losses]


def interleaved_samples(
    fns: dict[str, Callable[[], Any]], *, reps: int = 5, warmup: int = 1, rotate: bool = False
) -> dict[str, list[float]]:
    """Wall seconds of every timed call of each zero-argument callable, timed round-robin.

    Args:
        fns: ``{name: fn}``; each ``fn()`` runs the work once (its result is blocked on).
        reps: timed rounds (every candidate once per round).
        warmup: untimed rounds first (compilation, caches).
        rotate: start round ``r`` at candidate ``r mod len(fns)`` (no candidate always first).

    Returns:
        ``{name: [seconds of round 0, 1, ...]}``.

    Example::

        >>> samples = interleaved_samples({"a": lambda: 1, "b": lambda: 2}, reps=3, rotate=True)
        >>> {k: len(v) for k, v in samples.items()}
        {'a': 3, 'b': 3}
    """
    _positive("reps", reps)
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            samples[name].append(time.perf_counter() - start)
    return samples


def time_interleaved(
    fns: dict[str, Callable[[], Any]], *, reps: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median wall seconds of each zero-argument callable, timed round-robin
    (:func:`interleaved_samples`).

    Args:
        fns: ``{name: fn}``; each ``fn()`` runs the work once (its result is blocked on).
        reps: timed rounds (every candidate once per round).
        warmup: untimed rounds first (compilation, caches).

    Returns:
        ``{name: median seconds}``.
    """
    samples = interleaved_samples(fns, reps=reps, warmup=warmup)
    return {name: statistics.median(values) for name, values in samples.items()}


def speedup(baseline: Callable[[], Any], method: Callable[[], Any], *, reps: int = 5,
            warmup: int = 1) -> float:
    """``time(baseline) / time(method)``: medians of :func:`time_interleaved` (same rounds).

    Example::

        >>> import jax.numpy as jnp
        >>> x = jnp.ones((64, 64))
        >>> speedup(lambda: (x @ x) @ x, lambda: x @ x, reps=3) > 0
        True
    """
    times = time_interleaved({"baseline": baseline, "method": method}, reps=reps, warmup=warmup)
    return times["baseline"] / times["method"]


def decode_rates(decoders: dict[str, tuple[Callable, Any]], token, *, steps: int,
                 warmup: int = 1, rounds: int = 3) -> dict[str, list[float]]:
    """Tokens per second of ``steps`` decode steps of each decoder, per interleaved round.

    ``decoders[name] = (step, state)`` with ``step(state, token) -> (logits, state)`` (e.g.
    :func:`lowrank_jax.kv.start_kv_decode`). Each is compiled first, in order (``warmup``
    steps from ``state``); every round then times ``steps`` steps from the state after its
    first step, every decoder once per round (:func:`interleaved_samples`), so a load change
    on a shared machine hits all of them alike.

    Example::

        >>> import jax.numpy as jnp
        >>> step = lambda state, token: (state + token, state + 1)
        >>> rates = decode_rates({"add": (step, jnp.zeros(()))}, 1.0, steps=2, rounds=2)
        >>> len(rates["add"]), all(r > 0 for r in rates["add"])
        (2, True)
    """
    firsts = {}
    for name, (step, state) in decoders.items():
        logits, firsts[name] = step(state, token)
        for _ in range(warmup - 1):
            logits, _ = step(firsts[name], token)
        jax.block_until_ready(logits)

    def run(name):
        step, current = decoders[name][0], firsts[name]
        for _ in range(steps):
            logits, current = step(current, token)
        return logits

    samples = interleaved_samples({name: (lambda n=name: run(n)) for name in decoders},
                                  reps=rounds, warmup=0)
    return {name: [steps / seconds for seconds in values] for name, values in samples.items()}


def reference_matmul_seconds(flops: float, *, reps: int = 3) -> tuple[float, int]:
    """Time of the same-run baseline of a benchmark: one jitted fp32 ``n×n @ n×n`` matmul with
    ``2n³ ≈ flops`` (compare an op's time to it, not to an absolute clock).

    Returns:
        ``(median seconds, n)``.

    Example::

        >>> seconds, n = reference_matmul_seconds(2 * 16**3, reps=1)
        >>> n, seconds > 0
        (16, True)
    """
    import jax.numpy as jnp

    n = int(round((flops / 2) ** (1 / 3)))
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    return time_fn(jax.jit(lambda x, y: x @ y), a, b, reps=reps, warmup=1), n


@contextlib.contextmanager
def cpu_usage():
    """Measure the CPU cost of a ``with`` block: yields a dict, filled when the block ends, with
    ``cpu_seconds`` (user + system of this process and its children) and ``load_average``
    (the 1-minute load average at the start and at the end: how shared the machine was).

    Example::

        >>> with cpu_usage() as usage:
        ...     _ = sum(range(10_000))
        >>> usage["cpu_seconds"] >= 0, len(usage["load_average"])
        (True, 2)
    """
    usage: dict[str, Any] = {}
    load0, start = os.getloadavg()[0], os.times()
    try:
        yield usage
    finally:
        end = os.times()
        usage["cpu_seconds"] = sum(end[:4]) - sum(start[:4])
        usage["load_average"] = (load0, os.getloadavg()[0])


def machine_record() -> dict:
    """Where and with what a benchmark ran: date (UTC), host, CPU count, versions, devices."""
    import flax
    import optax

    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "host": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
    }


__all__ = ["cpu_usage", "decode_rates", "interleaved_samples", "machine_record",
           "reference_matmul_seconds", "speedup", "time_compiled", "time_fn", "time_interleaved",
           "time_once", "time_steps"]
