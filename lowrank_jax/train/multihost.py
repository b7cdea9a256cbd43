"""Several JAX processes, one run: a local launcher, process-0 guards, and shared-folder checks.

JAX is multi-controller: every process (one per host on a TPU pod slice or a GPU cluster) runs
the same program, holds the shards of the global arrays that live on its devices, and meets the
others in collectives. What this module adds on top of ``jax.distributed``:

- :func:`launch` starts ``N`` processes on this machine (a free localhost port as coordinator,
  ``--xla_force_host_platform_device_count`` CPU devices each, gloo CPU collectives), streams
  their output with a ``[p0]`` / ``[p1]`` prefix and fails fast: when one process fails, the
  others are stopped within seconds and the reason is returned (``lowrank-jax launch``);
- :func:`is_main_process` / :func:`on_main_process`: files (metrics, plots, summaries, adapters)
  are written once, by process 0, and a failure there is raised on every process (no hang);
- :func:`check_shared_folder`: a ``run_dir`` that every process must see (orbax writes one
  checkpoint from all of them) is checked at start — process 0 writes a nonce file, the others
  look for it within a timeout — so a per-host folder is one clear error instead of a hang at
  the first checkpoint barrier;
- :func:`sharded_batch`: each process builds only its own rows of a global batch (the batch of
  step ``t`` depends only on ``(seed, t)``, so restarts see the same data);
- :func:`gather_to_host` / :func:`host_copy`: a pytree (an NNX model) of arrays that are not
  fully addressable, as whole numpy arrays on every process (for merging, exporting adapters,
  saving a merged model);
- :func:`install_interrupt_watchdog`: a SIGTERM that arrives while the main thread is stuck in a
  collective (a peer is gone) ends the process after a bounded time, with a message, instead of
  waiting forever for the interrupt checkpoint.

Example (two processes of four CPU devices each, sharing ``runs/mh``)::

    lowrank-jax launch --processes 2 --devices-per-process 4 -- \\
        pretrain --mesh data=2,fsdp=4 --set run_dir=runs/mh --set train.steps=10
"""

from __future__ import annotations

import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

CHECK_PREFIX = ".lowrank-jax-shared-check-"


# ----------------------------------------------------------------------------- launcher


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def process_env(process_id: int, processes: int, devices_per_process: int, port: int,
                base: dict | None = None) -> dict[str, str]:
    """The environment of local process ``process_id`` (read by
    :func:`lowrank_jax.train.sharding.maybe_initialize_distributed`)."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    env.update({
        "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
        "JAX_NUM_PROCESSES": str(processes),
        "JAX_PROCESS_ID": str(process_id),
        "XLA_FLAGS": " ".join(flags),
        "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu") or "cpu",
        # jax reads JAX_* config options from the environment: the CPU collectives that work
        # across processes (the default CPU client cannot run a cross-process all-reduce)
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def _describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _stream(pipe, prefix: str, out) -> None:
    for line in iter(pipe.readline, ""):
        out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
        out.flush()
    pipe.close()


def launch(command: Sequence[str], *, processes: int, devices_per_process: int,
           stop_timeout: float = 5.0, out=None, poll_s: float = 0.1,
           on_start: Callable[[list[subprocess.Popen]], None] | None = None) -> tuple[int, str]:
    """Run ``command`` as ``processes`` JAX processes on this machine; return ``(status, why)``.

    Every process gets the environment of :func:`process_env` (one coordinator on a free
    localhost port). Output lines are streamed to ``out`` (default stdout) prefixed ``[pI] ``.
    When a process fails (non-zero status), the others get SIGTERM, then SIGKILL after
    ``stop_timeout`` seconds; ``why`` says which process failed and how.

    Args:
        command: the argv of each process (e.g. ``[sys.executable, "-m", "lowrank_jax.cli",
            "pretrain", ...]``).
        processes: number of processes (>= 1).
        devices_per_process: CPU devices each process simulates (>= 1).
        stop_timeout: seconds between SIGTERM and SIGKILL for the surviving processes.
        on_start: called with the ``Popen`` objects once all are started (tests use it).

    Returns:
        ``(0, "")`` when every process succeeded, else the failing status and a one-line reason.
    """
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if not command:
        raise ValueError("command is empty; give the command each process runs.")
    out = sys.stdout if out is None else out
    port = free_port()
    procs, threads = [], []
    for i in range(processes):
        proc = subprocess.Popen(list(command), env=process_env(i, processes, devices_per_process,
                                                               port),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        procs.append(proc)
        thread = threading.Thread(target=_stream, args=(proc.stdout, f"[p{i}] ", out),
                                  daemon=True)
        thread.start()
        threads.append(thread)
    if on_start is not None:
        on_start(procs)
    status, why = 0, ""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first, code = failed[0]
                status = code if code > 0 else 128 - code
                then = ("fix what they name and run again" if code == 2  # a usage error
                        else "rerun with --resume to continue from the last complete checkpoint")
                why = (f"process {first} of {processes} {_describe_status(code)}; the other "
                       "processes were stopped. Its last lines above (prefix "
                       f"[p{first}]) say why; {then}.")
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        status, why = 130, "interrupted; all processes were stopped."
    finally:
        _stop_all(procs, stop_timeout)
        for thread in threads:
            thread.join(timeout=2.0)
    return status, why


def _stop_all(procs: list[subprocess.Popen], stop_timeout: float) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        for sig in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: a stopped process acts on it
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + stop_timeout
    for p in alive:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# ----------------------------------------------------------------------------- process 0


def process_index() -> int:
    import jax

    return jax.process_index()


def is_main_process() -> bool:
    """``True`` on the process that writes files (process 0; always true in one process)."""
    return process_index() == 0


def _broadcast_flag(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a collective: every process must call it)."""
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def on_main_process(fn: Callable[[], object], *, what: str):
    """Run ``fn`` on process 0 only; every process returns, or every process raises.

    Process 0 re-raises its own error; the others raise a ``ValueError`` that points at it, so
    no process waits forever in the next collective for one that failed.
    """
    result, error = None, None
    if is_main_process():
        try:
            result = fn()
        except Exception as caught:  # noqa: BLE001 - re-raised below, after telling the others
            error = caught
    failed = _broadcast_flag(error is not None)
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{what} failed on process 0 (its message, prefixed [p0], says why).")
    return result


def check_shared_folder(folder: str | os.PathLike, *, argument: str = "run_dir",
                        timeout_s: float | None = None) -> None:
    """Check that every process sees the same ``folder`` (a shared filesystem); no-op alone.

    Process 0 creates ``folder`` and writes a nonce file in it; every process looks for that
    file for up to ``timeout_s`` seconds (network filesystems may lag); the results are
    gathered, so every process raises the same error, naming the processes that could not see
    it. The nonce file is removed again. ``timeout_s=None`` reads the environment variable
    ``LOWRANK_JAX_SHARED_FOLDER_TIMEOUT`` (seconds; 10 when unset), so a launched command can
    be given a longer wait for a slow filesystem (or a shorter one) without a flag.

    Raises:
        ValueError: some process cannot see process 0's file in ``folder``.
    """
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    if timeout_s is None:
        timeout_s = float(os.environ.get("LOWRANK_JAX_SHARED_FOLDER_TIMEOUT", "10"))
    folder = pathlib.Path(folder)
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(31))))
    probe = folder / f"{CHECK_PREFIX}{nonce}"
    if is_main_process():
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text(str(nonce))
    multihost_utils.sync_global_devices(f"lowrank_jax shared check {nonce} written")
    deadline = time.monotonic() + timeout_s
    seen = probe.exists()
    while not seen and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = probe.exists()
    flags = np.asarray(multihost_utils.process_allgather(np.int32(seen))).reshape(-1)
    if is_main_process():
        probe.unlink(missing_ok=True)
    missing = [i for i, flag in enumerate(flags) if not flag]
    if missing:
        raise ValueError(
            f"{argument} {folder} is not shared by all {jax.process_count()} processes: "
            f"process(es) {', '.join(map(str, missing))} cannot see the file process 0 wrote "
            f"there (waited {timeout_s:g} s). Every process writes its part of each checkpoint "
            f"into the same folder: put {argument} on a filesystem all hosts mount (NFS, "
            "Lustre, a GCS/S3 bucket path) and pass the same path to every process.")


# ----------------------------------------------------------------------------- arrays


def sharded_batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int,
                  sharding) -> tuple:
    """The global batch of ``step`` as two jax Arrays on ``sharding``, built per process.

    Each process materialises only the rows its devices hold (:func:`lowrank_jax.data.batch_at`
    with ``rows=``); the values equal ``jax.device_put(batch_at(...), sharding)``.
    """
    import jax

    from lowrank_jax.data import batch_at

    parts: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def rows_of(index):
        rows = index[0] if index else slice(None)
        key = (rows.start, rows.stop, rows.step)
        if key not in parts:
            parts[key] = batch_at(tokens, step, batch_size, seq_len, seed, rows=rows)
        return parts[key], (slice(None),) + tuple(index[1:])

    def inputs(index):
        (x, _), rest = rows_of(index)
        return x[rest]

    def targets(index):
        (_, y), rest = rows_of(index)
        return y[rest]

    shape = (batch_size, seq_len)
    return (jax.make_array_from_callback(shape, sharding, inputs),
            jax.make_array_from_callback(shape, sharding, targets))


def process_rows(sharding, shape: tuple[int, ...]) -> range:
    """The rows of a global ``shape`` batch that this process's devices hold under ``sharding``
    (a contiguous range; several processes may hold the same rows when the batch is replicated
    over a mesh axis that spans them).

    Example::

        >>> import jax
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        >>> process_rows(NamedSharding(mesh, P("data")), (4, 3))
        range(0, 4)
    """
    spans = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows = index[0] if index else slice(None)
        spans.add(rows.indices(shape[0])[:2])
    spans = sorted(spans)
    lo, hi = spans[0][0], spans[0][1]
    for start, stop in spans[1:]:
        if start > hi:
            raise ValueError(
                f"this process holds rows {spans} of the batch, not one contiguous block; order "
                "the mesh's devices so that each process's devices are adjacent along the data "
                "axes (jax.make_mesh does).")
        hi = max(hi, stop)
    return range(lo, hi)


def global_batch(local, sharding, batch_size: int):
    """One global ``jax.Array`` per leaf of ``local`` (this process's rows, see
    :func:`process_rows`), laid out on ``sharding`` with ``batch_size`` rows in all
    (``jax.make_array_from_process_local_data``)."""
    import jax

    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x), (batch_size,) + tuple(np.shape(x)[1:])), local)


def gather_to_host(tree):
    """``tree`` with every jax Array as a full numpy array, on every process.

    Arrays that are not fully addressable (sharded over several processes) are all-gathered
    (a collective: every process must call this with the same tree); the others are copied.
    """
    import jax

    def one(leaf):
        if not isinstance(leaf, jax.Array):
            return leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # RNG keys stay keys
            return jax.random.wrap_key_data(one(jax.random.key_data(leaf)),
                                            impl=jax.random.key_impl(leaf))
        if not leaf.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(leaf)

    return jax.tree.map(one, tree)


def host_copy(model):
    """A copy of the NNX ``model`` whose arrays are whole arrays on this process's first
    device, on every process.

    The model (left unchanged) may be sharded over several processes: its arrays are gathered
    with :func:`gather_to_host` (a collective: every process calls this). The copy can be
    merged, exported or saved with code that reads arrays on the host (``np.asarray``), which
    fails on an array that is not fully addressable.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    local = jax.tree.map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x,
                         gather_to_host(state))
    return nnx.merge(graphdef, local)


# ----------------------------------------------------------------------------- SIGTERM


_WATCHDOG: dict[str, object] = {}


def install_interrupt_watchdog(timeout_s: float = 60.0, *, log=None) -> None:
    """Bound how long a SIGTERM may take: after ``timeout_s`` seconds the process exits (143).

    The usual SIGTERM path (a handler raising ``KeyboardInterrupt``, then the interrupt
    checkpoint) needs the main thread back in Python. A process stuck in a collective or a
    checkpoint barrier (another process is gone) never gets there, so it would ignore SIGTERM.
    Python's C-level handler writes every signal number to :func:`signal.set_wakeup_fd` at
    once; a daemon thread reads it and, ``timeout_s`` seconds after a SIGTERM, prints a message
    and ends the process. Call from the main thread, after installing the SIGTERM handler.
    """
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds.")
    if threading.current_thread() is not threading.main_thread():
        return
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    if "thread" in _WATCHDOG:
        _WATCHDOG["timeout_s"] = float(timeout_s)
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _WATCHDOG["timeout_s"] = float(timeout_s)

    def watch():
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            if signal.SIGTERM in data:
                wait = float(_WATCHDOG["timeout_s"])
                time.sleep(wait)
                log(f"SIGTERM received {wait:g} s ago and the process is still running: it is "
                    "stuck in a collective or a checkpoint barrier (another process is probably "
                    "gone). Giving up the interrupt checkpoint and exiting; continue with "
                    "--resume from the last complete checkpoint.")
                os._exit(143)

    thread = threading.Thread(target=watch, name="lowrank-jax-sigterm-watchdog", daemon=True)
    thread.start()
    _WATCHDOG["thread"] = thread


__all__ = ["check_shared_folder", "free_port", "gather_to_host", "host_copy",
           "global_batch", "install_interrupt_watchdog",
           "is_main_process", "launch", "on_main_process", "process_env", "process_index",
           "process_rows", "sharded_batch"]
