"""Sphinx configuration of the lowrank_jax documentation (build: see docs/index.md)."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "lowrank_jax"
author = "lowrank_jax authors"
copyright = "2026, lowrank_jax authors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "results", "generated", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True

html_theme = "sphinx_rtd_theme"
html_title = "lowrank_jax"
html_static_path = []
# MathJax loads from its CDN unless a local copy sits in docs/_static/mathjax/ (for offline
# machines: `npm install mathjax@3 --prefix docs/_build/mj && mkdir -p docs/_static/mathjax &&
# cp docs/_build/mj/node_modules/mathjax/es5/tex-svg.js docs/_static/mathjax/`; git ignores it).
if os.path.exists(os.path.join(os.path.dirname(__file__), "_static", "mathjax", "tex-svg.js")):
    html_static_path = ["_static"]
    mathjax_path = "mathjax/tex-svg.js"
html_theme_options = {"navigation_depth": 3, "collapse_navigation": True}


# --- Public constants re-exported by a package ----------------------------------------------
# autodoc reads a constant's ``#:`` comment from the module it documents; a package's
# ``__init__`` only imports it, so docs/api lists such constants with ``autodata``. Find the
# module that assigns the constant (the same object) and use its comment as the docstring.

def _constant_docs() -> dict[tuple[str, str], list[str]]:
    import importlib
    import inspect
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    import lowrank_jax
    import lowrank_jax.nn  # noqa: F401  (the import order the package expects)
    import pallas_kernels

    docs: dict[tuple[str, str], list[str]] = {}
    modules = {}
    for root in (lowrank_jax, pallas_kernels):
        modules[root.__name__] = root
        for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
            modules[info.name] = importlib.import_module(info.name)
    for package_name, package in list(modules.items()):
        for name in getattr(package, "__all__", []):
            obj = getattr(package, name)
            if inspect.ismodule(obj) or inspect.isroutine(obj) or inspect.isclass(obj):
                continue
            for mod_name, mod in modules.items():
                if vars(mod).get(name) is not obj:
                    continue
                comments = ModuleAnalyzer.for_module(mod_name).find_attr_docs()
                if ("", name) in comments:
                    docs[(package_name, name)] = list(comments[("", name)])
                    break
    return docs


_CONSTANTS: dict[tuple[str, str], list[str]] = {}


def _constant_docstring(app, what, name, obj, options, lines):
    if what == "data":
        module, _, short = name.rpartition(".")
        if (module, short) in _CONSTANTS:
            lines[:] = _CONSTANTS[(module, short)] + [""]


# A broken cross-reference to our own names fails the strict build; references to other
# libraries' objects (jax.Array, optax.GradientTransformation, type hints) are not checked here.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!lowrank_jax\.|pallas_kernels\.).*")]

# Docstrings name objects by their defining module (``lowrank_jax.nn.capture.capture``) while the
# API reference documents them where users import them (``lowrank_jax.nn.capture`` is not a
# page; ``lowrank_jax.nn`` is). Resolve such a reference to the public name of the same object;
# a reference to an existing object that has no public name (a private helper, an internal
# module) becomes plain text; a reference to something that does not exist still fails.

def _public_names() -> dict[int, str]:
    import importlib
    import pkgutil

    import lowrank_jax
    import pallas_kernels

    public: dict[int, str] = {}
    for root in (lowrank_jax, pallas_kernels):
        packages = [root.__name__] + [m.name for m in pkgutil.walk_packages(
            root.__path__, root.__name__ + ".") if m.ispkg]
        for package in packages:
            module = importlib.import_module(package)
            for name in getattr(module, "__all__", []):
                public.setdefault(id(getattr(module, name)), f"{package}.{name}")
    return public


def _import_target(target: str):
    import importlib

    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


_PUBLIC: dict[int, str] = {}


def _resolve_alias(app, env, node, contnode):
    from sphinx.util.nodes import make_refnode

    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith(("lowrank_jax.", "pallas_kernels.")):
        return None
    obj = _import_target(target)
    if obj is None:
        return None  # a broken reference: the strict build reports it
    public = _PUBLIC.get(id(obj))
    entry = env.get_domain("py").objects.get(public) if public else None
    if entry is None:
        return contnode
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, public)


def setup(app):
    _CONSTANTS.update(_constant_docs())
    _PUBLIC.update(_public_names())
    app.connect("autodoc-process-docstring", _constant_docstring)
    app.connect("missing-reference", _resolve_alias)
