"""Count the house rules of issues 37 and 52 from the source (``ast`` only, nothing imported).

    python scripts/house_counts.py            # the table
    python scripts/house_counts.py --details  # and every offending edge / function

Counts:

- **import circles**: strongly connected components (size > 1) of the graph of imports between
  ``lowrank_jax`` modules, imports inside functions included, module names in string literals
  (``importlib.import_module("lowrank_jax....")``, registries of module names) included; importing
  ``a.b.c`` also runs the ``__init__`` of ``a.b``, so that edge is added too (a child
  importing its own package's ``__init__`` is not counted);
- **upward arrows**: imports from a lower floor to a higher one (``FLOORS`` below);
- **private imports**: ``from lowrank_jax.x import _name`` (or ``import lowrank_jax.x._y``) from
  another module, and the same inside ``pallas_kernels`` (a package's private module, such as
  ``pallas_kernels._dispatch``, may be imported by the modules under that package);
- **kernel ops without BlockSizes**: op packages under ``pallas_kernels/`` whose ``api.py`` does not
  define or import a ``BlockSizes`` class;
- **training steps**: functions (package + scripts) that call ``value_and_grad``/``grad`` and an
  optimizer ``update``;
- **training loops**: functions (package + scripts) with a ``for``/``while`` loop that runs a
  training step: its body assigns a tuple of three or more names from a call that is either named
  like a step (``step``, ``step_fn``, ``run_step``, ``_adam_step``, ...) or that passes back its
  first two arguments (``params, opt_state, loss = local(params, opt_state, ...)``), or its body
  both takes a gradient (``value_and_grad``/``grad``) and calls an optimizer ``update``; the
  functions a loop only defines are not part of it (see :func:`training_loops`). Issue 52: 17
  before the one loop (16 in the package, 1 in scripts), the one loop
  (``core/loop.py``) after;
- **NLL implementations**: functions that compute a token NLL from ``log_softmax``/``logsumexp``;
- **lines of scripts/**: every ``*.py`` line under ``scripts/`` but this counter's own (issue 37:
  8,090 when the move of library logic out of the scripts began; at most 8,090 - 1,500). The
  counter is a measuring tool, not library logic, and grew by the counts of issue 52; counting it
  would make each new house count eat the budget of the move it measures;
- **adapter bodies** (issue 52): package functions that apply a LoRA update to an input: they
  hold a chained product ``(x @ A) @ B`` and read a LoRA factor (a name, attribute or key
  starting with ``lora_``) or are named for one (the function's or its class's name contains
  ``lora`` or ``adapter``); the one body is ``lowrank_jax.nn.lora.lora_output`` (a factorized
  layer's ``(x @ a) @ b`` is its weight, not an adapter; the per-example gathers of K adapters,
  ``einsum`` pairs in ``MultiLoRALinear`` and the hypernetwork's bank, are dispatch, not counted);
- **dense-weight accessors** (issue 52): distinct names (leading ``_`` ignored) of package
  functions / methods in ``DENSE_ACCESSOR_SYNONYMS`` or matching ``DENSE_ACCESSOR_PATTERN``
  (a layer's method of the same name as the function is the same idea: one name);
- **pair finders** (issue 52): distinct names (leading ``_`` ignored) of package functions in
  ``PAIR_FINDER_SYNONYMS`` or matching ``PAIR_FINDER_PATTERN`` (``*pairs``, ``*pair_paths``);
- **homonyms** (issue 52): public top-level names (``def``, ``class``, assignment; no leading
  ``_``) defined in two or more modules of ``lowrank_jax`` / ``pallas_kernels`` (a re-export
  ``from x import name`` is not a definition), except the names of a plugin protocol that every
  module of one family defines on purpose (``PROTOCOL_NAMES``);
- **deep imports past a face** (issue 52): ``from lowrank_jax.pkg.module import name`` in a
  command (``lowrank_jax/commands/``) where ``name`` is in ``lowrank_jax.pkg``'s ``__all__``:
  the command should import it from the face (``from lowrank_jax.pkg import name``). A name
  the face does not export (a command's own validators, an application's internals) is not
  counted.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "lowrank_jax"
KERNELS = "pallas_kernels"
SCRIPT_LINES_BASELINE = 8090  # scripts/*.py when issue 37's move began

# Floors, lowest first. A module may import its own floor or any floor below it. An entry names a
# top-level subpackage or module of the package (a folder, never a module inside one), and
# modules no entry names sit on the top floor (applications and clients).
FLOORS: list[tuple[str, ...]] = [
    # the ground: shared maths (linear algebra, k-means, packing, sharding, losses, the step) and
    # a run's surroundings (output folders, locks, stop signals, quiet logs, input checks, records)
    ("core", "runs"),
    # layers, optax transforms, kernels' dispatch, quantizers of one matrix, data
    ("optim", "curvature", "ot", "attention", "nn", "data", "quant"),
    # adapter and checkpoint formats over the layers
    ("io",),
    # the one model core
    ("models",),
    # what runs on a model: the hub that loads every format, the quantize application (pipelines,
    # end-to-end fine-tuning, the folder format, QLoRA bases), serving, analysis, KV-cache
    # methods, editing, hypernetworks, federated
    ("hub", "quantize", "serve", "analysis", "kv", "editing", "hyper", "federated"),
    # training applications and their infrastructure
    ("train",),
    # clients
    ("bench", "commands", "cli"),
]


@functools.cache
def parse(path: pathlib.Path) -> ast.Module:
    """The syntax tree of a source file, parsed once for all the counts (read-only use)."""
    return ast.parse(path.read_text(), filename=str(path))


def floor_of(module: str) -> int:
    """The floor of a ``lowrank_jax.x.y`` module: the floor of its top-level folder ``x``."""
    assert not any("." in name for names in FLOORS for name in names), "floors name folders only"
    parts = module.split(".")[1:]
    top = parts[0] if parts else ""
    for level, names in enumerate(FLOORS):
        if top in names:
            return level
    return len(FLOORS) - 1


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules(package: str = PACKAGE) -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The longest prefix of ``name`` that is a package module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]):
    """Yield (target module, imported names) for every import in ``path``."""
    tree = parse(path)
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    yield target, [alias.name.rsplit(".", 1)[-1]] if target != alias.name else []
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = _known(f"{base}.{alias.name}", modules)
                if sub and sub == f"{base}.{alias.name}":
                    yield sub, []
                else:
                    target = _known(base, modules)
                    if target:
                        yield target, [alias.name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # importlib strings: any string literal naming a package module
            value = node.value
            if value.startswith(PACKAGE + ".") and value in modules:
                yield value, []


def import_graph(modules: dict[str, pathlib.Path]):
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[tuple[str, str, str]] = []
    for module, path in modules.items():
        for target, names in _imports(module, path, modules):
            if target == module:
                continue
            edges[module].add(target)
            # importing a.b.c runs a/__init__ and a/b/__init__ first: real edges to those packages
            parts = target.split(".")
            for length in range(2, len(parts)):
                package = ".".join(parts[:length])
                if package in modules and not module.startswith(package + ".") \
                        and module != package:
                    edges[module].add(package)
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    private.append((module, target, name))
            if target.rsplit(".", 1)[-1].startswith("_") and not target.endswith("__init__"):
                last = target.rsplit(".", 1)[-1]
                if not last.startswith("__") and not module.startswith(target.rsplit(".", 1)[0]):
                    private.append((module, target, last))
    return edges, private


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _is_package_edge(importer: str, target: str) -> bool:
    """A package's ``__init__`` re-exporting its own children is not an arrow between floors."""
    return target.startswith(importer + ".") or importer.startswith(target + ".")


def upward_arrows(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (m, t)
        for m, targets in edges.items()
        for t in targets
        if floor_of(t) > floor_of(m) and not _is_package_edge(m, t)
    )


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """SCCs; a module importing its own package's ``__init__`` (child -> parent) is not counted
    (the package is being imported already), a package re-exporting its children is."""
    pruned = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    return strongly_connected(pruned)


def ops_without_block_sizes() -> tuple[list[str], list[str]]:
    ops, missing = [], []
    for api in sorted((ROOT / "pallas_kernels").glob("*/api.py")):
        op = api.parent.name
        ops.append(op)
        tree = parse(api)
        has = any(
            isinstance(n, ast.ClassDef) and n.name == "BlockSizes" for n in ast.walk(tree)
        ) or any(
            isinstance(n, ast.ImportFrom) and any(a.name == "BlockSizes" for a in n.names)
            for n in ast.walk(tree)
        )
        if not has:
            missing.append(op)
    return ops, missing


def _calls(node: ast.AST) -> list[str]:
    names = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute):
                base = func.value
                prefix = base.id if isinstance(base, ast.Name) else (
                    base.attr if isinstance(base, ast.Attribute) else ""
                )
                names.append(f"{prefix}.{func.attr}")
            elif isinstance(func, ast.Name):
                names.append(func.id)
    return names


def _source_files() -> list[pathlib.Path]:
    files = sorted((ROOT / PACKAGE).rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))
    return [f for f in files if f.name != "house_counts.py"]


GRAD_CALLS = {"value_and_grad", "grad"}


def _outermost_functions(tree: ast.AST):
    """Functions not nested in another function (a step builder and its inner step count once)."""
    out = []

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            is_fn = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_fn and not inside:
                out.append(child)
            visit(child, inside or is_fn)

    visit(tree, False)
    return out


def _functions_where(holds) -> list[str]:
    """``path:line name`` of the outermost functions (package + scripts) for which ``holds``."""
    return [f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}" for path in _source_files()
            for fn in _outermost_functions(parse(path)) if holds(fn)]


def training_steps() -> list[str]:
    def holds(fn):
        calls = _calls(fn)
        updates = any(c.endswith(".update") and c.split(".")[0] in {"tx", "optimizer", "opt"}
                      or c.endswith("tx.update") for c in calls)
        return updates and any(c.rsplit(".", 1)[-1] in GRAD_CALLS for c in calls)

    return _functions_where(holds)


def _threads_state(node: ast.Assign) -> bool:
    """``a, b, c = f(...)``: a step call, by its name (``step``, ``*_step``, ``*step_fn``) or
    because it passes back its first two arguments as its first two results
    (``params, opt_state, loss = local(params, opt_state, x)``)."""
    target = node.targets[0] if len(node.targets) == 1 else None
    if not (isinstance(target, ast.Tuple) and len(target.elts) >= 3
            and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if re.search(r"(^|_)step(_fn)?$", name.lower()):  # step, step_fn, run_step, _adam_step
        return True

    def name_of(node):
        return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)

    targets = [name_of(e) for e in target.elts[:2]]
    args = [name_of(a) for a in node.value.args[:2]]
    return None not in targets and targets == args


def _run_by(loop: ast.AST):
    """The nodes a loop runs: its body, without the functions it only defines."""
    todo = list(ast.iter_child_nodes(loop))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _is_training_loop(loop: ast.AST) -> bool:
    body = list(_run_by(loop))
    if any(isinstance(n, ast.Assign) and _threads_state(n) for n in body):
        return True
    calls = [c.rsplit(".", 1)[-1] for n in body for c in _calls(n)]
    return any(c in GRAD_CALLS for c in calls) and "update" in calls


def training_loops() -> list[str]:
    """Functions (outermost, so a trainer and its inner helpers count once) holding a training
    loop: a ``for``/``while`` whose body runs a step (:func:`_threads_state`) or takes a gradient
    and calls an optimizer ``update``."""
    return _functions_where(lambda fn: any(
        _is_training_loop(n) for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))))


def nll_implementations() -> list[str]:
    """Functions that take log_softmax / logsumexp of logits and pick the target token."""
    def holds(fn):
        calls = {c.rsplit(".", 1)[-1] for c in _calls(fn)}
        return bool(calls & {"log_softmax", "logsumexp"}) and bool(
            calls & {"take_along_axis", "one_hot"})

    return _functions_where(holds)


def _package_trees(packages=(PACKAGE,)):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, parse(path)


def _functions(tree: ast.AST):
    """Every function or method of a module, nested ones included."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _adapter_named(name: str) -> bool:
    return "lora" in name.lower() or "adapter" in name.lower()


def _reads_lora_factor(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        name = (node.attr if isinstance(node, ast.Attribute) else node.id
                if isinstance(node, ast.Name) else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str) else "")
        if name.startswith("lora_") and name != "lora_output":  # calling the body is no body
            return True
    return False


def adapter_bodies() -> list[str]:
    """Functions holding ``(x @ A) @ B`` that read a LoRA factor (see the module docstring)."""
    found = []
    for path, tree in _package_trees():
        owner = {id(fn): cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                 for fn in cls.body}
        for fn in _functions(tree):
            named = _adapter_named(fn.name) or _adapter_named(owner.get(id(fn), ""))
            chained = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult)
                          and isinstance(n.left, ast.BinOp) and isinstance(n.left.op, ast.MatMult)
                          for n in ast.walk(fn))
            if chained and (named or _reads_lora_factor(fn)):
                found.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}")
    return found


#: the names the issue found for "a module's dense weight" (issue 52), and a pattern for new ones
DENSE_ACCESSOR_SYNONYMS = {"dense_matrix", "dense_weight", "dense_kernel", "kernel_matrix",
                           "weight_matrix", "full_weight", "merged_weight"}
DENSE_ACCESSOR_PATTERN = re.compile(
    r"^(dense|full|merged|effective|materiali[sz]ed?)_(weight|kernel|matrix)s?$"
    r"|^(get_)?(weight|kernel)_(matrix|dense)$")
#: the names the issue found for "find the factor pairs" (issue 52), and a pattern for new ones
PAIR_FINDER_SYNONYMS = {"find_pairs", "factor_pairs", "lora_pairs", "label_factors",
                        "find_lora_pairs", "lora_pair_paths", "weight_pairs"}
PAIR_FINDER_PATTERN = re.compile(r"pairs$|pair_paths$")


def _named(synonyms: set[str], pattern: re.Pattern) -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    for path, tree in _package_trees():
        for fn in _functions(tree):
            name = fn.name.lstrip("_")
            if name in synonyms or pattern.search(name):
                names.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{fn.lineno}")
    return names


def dense_accessors() -> dict[str, list[str]]:
    """``{name: [where it is defined]}`` of the dense-weight accessor names."""
    return _named(DENSE_ACCESSOR_SYNONYMS, DENSE_ACCESSOR_PATTERN)


def pair_finders() -> dict[str, list[str]]:
    """``{name: [where it is defined]}`` of the pair-finder names."""
    return _named(PAIR_FINDER_SYNONYMS, PAIR_FINDER_PATTERN)


#: names that every module of one plugin family defines on purpose: the same name is the same
#: idea there (a command module's ``register(subparsers)`` / ``run(args)``; a kernel op's
#: ``BlockSizes`` and its ``cases.py`` functions that ``scripts/gpu`` and the CI compile step call)
PROTOCOL_NAMES = {
    "lowrank_jax/commands/*.py": {"register", "run"},
    "pallas_kernels/*/api.py": {"BlockSizes"},
    "pallas_kernels/*/cases.py": {"compile_cases"},
}


def homonyms() -> dict[str, list[str]]:
    """``{name: [modules]}`` of public top-level names defined in two or more modules."""
    defined: dict[str, list[str]] = {}
    for path, tree in _package_trees((PACKAGE, KERNELS)):
        rel = path.relative_to(ROOT)
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        for name in names:
            protocol = any(rel.match(glob) and name in allowed
                           for glob, allowed in PROTOCOL_NAMES.items())
            if not name.startswith("_") and not protocol:
                defined.setdefault(name, []).append(str(rel))
    return {name: where for name, where in sorted(defined.items()) if len(where) > 1}


@functools.cache
def _face_names(package: str) -> frozenset[str]:
    """The literal ``__all__`` of ``lowrank_jax/<package>/__init__.py`` (empty if none)."""
    init = ROOT / PACKAGE / package / "__init__.py"
    if not init.is_file():
        return frozenset()
    for node in parse(init).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def deep_face_imports() -> list[str]:
    """``path:line module.name`` of each name a command imports from a module under a
    subpackage whose face (``__all__``) exports it."""
    found = []
    for path in sorted((ROOT / PACKAGE / "commands").glob("*.py")):
        for node in ast.walk(parse(path)):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            parts = node.module.split(".")
            if len(parts) < 3 or parts[0] != PACKAGE or parts[1] == "commands":
                continue
            face = _face_names(parts[1])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}"
                      for alias in node.names if alias.name in face]
    return found


def counts() -> dict[str, object]:
    modules = package_modules()
    edges, private = import_graph(modules)
    private += import_graph(package_modules(KERNELS))[1]  # the kernels' own private names
    ops, missing = ops_without_block_sizes()
    return {
        "circles": circles(edges),
        "upward": upward_arrows(edges),
        "private": sorted(set(private)),
        "ops": ops,
        "ops_missing_block_sizes": missing,
        "steps": training_steps(),
        "nll": nll_implementations(),
        "loops": training_loops(),
        "script_lines": sum(len(p.read_text().splitlines()) for p in _source_files()
                            if p.is_relative_to(ROOT / "scripts")),
        "adapter_bodies": adapter_bodies(),
        "dense_accessors": dense_accessors(),
        "pair_finders": pair_finders(),
        "homonyms": homonyms(),
        "deep_imports": deep_face_imports(),
    }


#: the ``--details`` label of each list of offenders after circles, arrows and private imports
DETAILS = {"ops_missing_block_sizes": "no BlockSizes", "steps": "step", "nll": "nll",
           "loops": "loop", "adapter_bodies": "adapter body",
           "dense_accessors": "dense-weight accessor", "pair_finders": "pair finder",
           "homonyms": "homonym", "deep_imports": "deep import"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--details", action="store_true", help="list every offender")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args(argv)
    c = counts()
    if args.json:
        print(json.dumps(c, indent=1))
        return 0
    rows = [
        ("import circles (SCCs)", len(c["circles"]), "0"),
        ("modules in circles", sum(len(s) for s in c["circles"]), "0"),
        ("upward arrows", len(c["upward"]), "0"),
        ("private-name imports", len(c["private"]), "0"),
        (
            "kernel ops with BlockSizes",
            f"{len(c['ops']) - len(c['ops_missing_block_sizes'])}/{len(c['ops'])}",
            "all",
        ),
        ("training-step implementations", len(c["steps"]), "<= 2"),
        ("NLL implementations", len(c["nll"]), "1"),
        ("training loops", len(c["loops"]), "1"),
        ("lines of scripts/", c["script_lines"], f"<= {SCRIPT_LINES_BASELINE - 1500}"),
        ("adapter bodies", len(c["adapter_bodies"]), "1"),
        ("dense-weight accessors", len(c["dense_accessors"]), "1"),
        ("pair finders", len(c["pair_finders"]), "1"),
        ("public names defined twice", len(c["homonyms"]), "0"),
        ("commands' imports past a face", len(c["deep_imports"]), "0"),
    ]
    print(f"{'count':34s} {'now':>8s} {'target':>8s}")
    for name, value, target in rows:
        print(f"{name:34s} {str(value):>8s} {target:>8s}")
    if args.details:
        for component in c["circles"]:
            print("circle:", " <-> ".join(component))
        for a, b in c["upward"]:
            print(f"upward: {a} -> {b}")
        for a, b, name in c["private"]:
            print(f"private: {a} imports {b}.{name}")
        for key, label in DETAILS.items():
            found = c[key]
            for item in found:  # a list of places, or {name: [places]}
                where = f"{item} ({', '.join(found[item])})" if isinstance(found, dict) else item
                print(f"{label}: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
