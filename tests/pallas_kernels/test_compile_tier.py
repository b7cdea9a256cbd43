"""The compile tier: every public Pallas op compiled for TPU by libtpu and lowered for H100/H200.

Each op's ``pallas_kernels/<op>/cases.py`` lists its entry points (``compile_cases(size)``);
every case runs on every target through :func:`pallas_kernels.aot.check_case`, which fails when
the compiler rejects the kernel or when the module holds no Pallas kernel (a silent fallback to
XLA). TPU targets need libtpu (``pip install -e ".[tpu]"``); without it these tests fail with
that command. The same matrix, as a table with the compiled memory, is
``python scripts/gpu/compile_matrix.py``.

Default run (seconds per case): H100/H200 lowering of every case; v5e compile of every small
case and of each op's first production shape (4096 tokens). ``-m slow``: the other production
shapes on v5e, SALE's production compiles, and v5p / v6e compiles of every production case.
"""

from __future__ import annotations

import importlib

import pytest

from pallas_kernels import aot

pytestmark = pytest.mark.xdist_group("pallas_kernels.test_compile_tier")

OPS = ("flash_attention", "sparse_attention", "subspace_attention", "xkv_decode",
       "grouped_lora", "lattice_matmul")
SIZES = ("production", "small")
DEFAULT_TARGETS = ("v5e", "h100", "h200")
SLOW_TARGETS = ("v5p", "v6e")  # production shapes only
#: Ops whose production TPU compile takes tens of seconds on a CPU host (SALE: 25-50 s, XLA's
#: TPU compile of its selection pipeline around the two kernels).
SLOW_TPU_OPS = ("sparse_attention",)


def _cases(op: str, size: str):
    """``[(id, case)]`` of ``op`` at ``size``, or ``[(id, exception)]`` when the op's cases.py
    cannot be imported or built (the test then fails with that error)."""
    try:
        module = importlib.import_module(f"pallas_kernels.{op}.cases")
        return [(f"{op}.{case.entry}.{size}{i}", case)
                for i, case in enumerate(module.compile_cases(size))]
    except Exception as err:  # reported by the test, not at collection
        return [(f"{op}.cases.{size}", err)]


def _slow(case, size: str, target: str, first_shape) -> bool:
    """Whether a (case, target) pair runs only under ``-m slow`` (module doc)."""
    if target in SLOW_TARGETS:
        return True
    if size != "production" or target not in aot.TPU_TARGETS:
        return False
    return case.op in SLOW_TPU_OPS or case.args[0].shape != first_shape


def _params():
    params = []
    for op in OPS:
        for size in SIZES:
            cases = _cases(op, size)
            first = next((c.args[0].shape for _, c in cases if isinstance(c, aot.CompileCase)),
                         None)
            for name, case in cases:
                if not isinstance(case, aot.CompileCase):  # one failing test says why
                    params.append(pytest.param(case, "-", id=name))
                    continue
                for target in DEFAULT_TARGETS + SLOW_TARGETS:
                    if target not in case.targets:
                        continue
                    if target in SLOW_TARGETS and size != "production":
                        continue
                    slow = _slow(case, size, target, first)
                    params.append(pytest.param(case, target, id=f"{name}-{target}",
                                               marks=[pytest.mark.slow] if slow else []))
    return params


@pytest.mark.parametrize("case, target", _params())
def test_case_compiles_with_its_kernel(case, target):
    if not isinstance(case, aot.CompileCase):
        raise AssertionError(f"the op's compile cases could not be built: {case!r}") from case
    if target in aot.TPU_TARGETS and not aot.has_libtpu():
        pytest.fail('compiling for TPU needs libtpu on this host: pip install -e ".[tpu]"')
    report = aot.check_case(case, target)
    assert report["kernels"] >= 1
    if target in aot.TPU_TARGETS:  # a compiled module reports its per-device memory
        assert report["argument_bytes"] > 0 and report["output_bytes"] > 0


def test_every_op_lists_cases_of_both_sizes():
    """Each op's cases.py builds cases for both sizes, from ShapeDtypeStructs, for all targets."""
    import jax

    for op in OPS[:4]:  # the attention ops; grouped_lora / lattice_matmul are checked above
        module = importlib.import_module(f"pallas_kernels.{op}.cases")
        for size in SIZES:
            cases = module.compile_cases(size)
            assert cases and all(case.op == op for case in cases)
            assert all(isinstance(a, jax.ShapeDtypeStruct) for c in cases for a in c.args)
            assert all(set(DEFAULT_TARGETS) <= set(c.targets) for c in cases)
        with pytest.raises(ValueError, match="size="):
            module.compile_cases("huge")
