"""The documentation site builds in strict mode and its API reference indexes every public name.

The public names are the ``__all__`` of ``lowrank_jax``, each of its subpackages and each
subpackage of ``pallas_kernels``; the built ``objects.inv`` (Sphinx's index of documented
objects) must hold ``<package>.<name>`` for each of them. A name whose docstring is missing is
left out by autodoc, so this also catches an undocumented public name.
"""

import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest
from sphinx.util.inventory import InventoryFile

import lowrank_jax
import lowrank_jax.nn  # noqa: F401  (the import order the packages expect)
import pallas_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def public_names() -> list[str]:
    names = []
    for root in (lowrank_jax, pallas_kernels):
        packages = [root.__name__] + [m.name for m in pkgutil.walk_packages(
            root.__path__, root.__name__ + ".") if m.ispkg]
        if root is lowrank_jax:
            packages.append("lowrank_jax.hub")  # the one top-level module with a public API
        for package in packages:
            names += [f"{package}.{n}" for n in getattr(importlib.import_module(package),
                                                        "__all__", [])]
    return sorted(names)


def indexed_names(objects_inv: pathlib.Path) -> set[str]:
    with objects_inv.open("rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    return {name for entries in inventory.values() for name in entries}


@pytest.fixture(scope="module")
def built_inventory(tmp_path_factory) -> pathlib.Path:
    """The strict build's objects.inv: docs/_build/html's when it is newer than every source,
    else a fresh strict build into a temporary folder (about 30 s on 2 cores)."""
    built = DOCS / "_build" / "html" / "objects.inv"
    sources = [p for d in (DOCS, ROOT / "lowrank_jax", ROOT / "pallas_kernels")
               for p in d.rglob("*") if p.suffix in (".py", ".md", ".rst")
               and "_build" not in p.parts]
    if built.exists() and built.stat().st_mtime > max(p.stat().st_mtime for p in sources):
        return built
    out = tmp_path_factory.mktemp("docs_html")
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                          "html", str(DOCS), str(out)], capture_output=True, text=True)
    assert run.returncode == 0, f"strict docs build failed:\n{run.stderr[-4000:]}"
    return out / "objects.inv"


def test_public_names_are_many():
    names = public_names()
    assert len(names) > 400 and "lowrank_jax.nn.apply_lora" in names


def test_every_public_name_is_in_the_api_reference(built_inventory):
    indexed = indexed_names(built_inventory)
    missing = [n for n in public_names() if n not in indexed]
    assert not missing, f"public names missing from the API reference: {missing}"



def test_every_method_page_is_in_the_navigation():
    pages = sorted(p.stem for p in (DOCS / "methods").glob("*.md") if p.stem != "index")
    assert len(pages) >= 17
    toc = (DOCS / "methods" / "index.md").read_text()
    assert [p for p in pages if f"\n{p}\n" in toc] == pages
    assert "methods/index" in (DOCS / "index.md").read_text()


def test_benchmarks_file_is_generated_and_up_to_date():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "build_benchmarks.py"),
                          "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.]*\w)", text))


def test_every_number_in_the_readme_is_in_the_benchmarks():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)  # code is checked by test_readme.py
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets are not numbers
    measured = set(re.findall(r"\d+(?:\.\d+)?", (ROOT / "BENCHMARKS.md").read_text()))
    numbers = _numbers(prose)
    assert {"2.967", "0.906", "12.77"} <= numbers  # the headline numbers are found
    missing = sorted(numbers - measured)
    assert not missing, f"README numbers not in the generated BENCHMARKS.md: {missing}"
