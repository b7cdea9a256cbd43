"""One battery for every optax transform exported by ``lowrank_jax.optim`` (like optax's
``_common_test.py``): jit and no-jit agree, ``inject_hyperparams`` changes nothing, the transform
behaves the same inside ``optax.chain`` and ``optax.partition``, the state keeps its sharding on
an 8-device mesh, and state dtypes stay what ``init`` made them.

Transforms are *discovered*: every public function of ``lowrank_jax.optim`` (and of the method
modules it exports) whose return annotation is an optax ``GradientTransformation``. Each needs an
entry in ``CASES`` below saying how to build it on a tiny parameter tree; a new transform without
one makes :func:`test_every_exported_transform_has_a_case` fail.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import lowrank_jax.optim as optim
from lowrank_jax.curvature.kfac import KFACFactor
from lowrank_jax.optim import crispedit as crispedit_module

# ----------------------------------------------------------------------------- discovery


def _is_transform_factory(obj) -> bool:
    if not inspect.isfunction(obj):
        return False
    annotation = inspect.signature(obj).return_annotation
    return "GradientTransformation" in str(getattr(annotation, "__name__", annotation))


def exported_transforms() -> dict[str, Callable]:
    """``{qualified name: factory}``, one entry per distinct function object."""
    found: dict[int, tuple[str, Callable]] = {}

    def scan(namespace, prefix):
        modules = []
        for name in getattr(namespace, "__all__", []):
            obj = getattr(namespace, name)
            if isinstance(obj, types.ModuleType) and obj.__name__.startswith("lowrank_jax.optim"):
                modules.append((name, obj))
            elif _is_transform_factory(obj):
                found.setdefault(id(obj), (f"{prefix}{name}", obj))
        for name, module in modules:  # after the package's own names: those name a factory
            scan(module, f"{name}.")

    scan(optim, "")
    return {name: fn for name, fn in found.values()}


# ----------------------------------------------------------------------------- the cases

ROOT = "target"  # every case's tree sits under this key (partition adds a sibling)


def _normal(seed, shape, dtype):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _factor_tree(dtype):
    return {"p": {"a": _normal(0, (8, 2), dtype), "b": _normal(1, (2, 8), dtype)}}


def _factor_and_norm_tree(dtype):
    return {**_factor_tree(dtype), "norm": _normal(2, (8,), dtype)}


def _lora_tree(dtype):
    return {"q": {"lora_a": _normal(3, (8, 2), dtype), "lora_b": _normal(4, (2, 8), dtype)}}


def _janus_args():
    return {"subspaces": {f"{ROOT}/q": jnp.eye(8, 2)}}


def _kernel_tree(dtype):
    return {"w": _normal(5, (8, 2), dtype)}


def _projector():
    factor = KFACFactor(jnp.diag(jnp.arange(1.0, 9.0)), jnp.diag(jnp.array([2.0, 1.0])),
                        jnp.array(1.0))
    return crispedit_module.build_projector({f"{ROOT}/w": factor}, energy=0.5)


def _b_tree(dtype):
    return {"b_g": _normal(6, (8, 3), dtype)}


SPECS = {  # sharding of each leaf name on the 8-device mesh (axis "x")
    "a": P("x", None), "b": P(None, "x"), "norm": P("x"), "lora_a": P("x", None),
    "lora_b": P(None, "x"), "w": P("x", None), "b_g": P("x", None),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """How to build one transform: ``make(**hyper)``, a tree, extra update args, and which
    numeric hyperparameters ``inject_hyperparams`` should turn into state."""

    make: Callable[..., optax.GradientTransformation]
    tree: Callable[[Any], dict]
    hyper: dict = dataclasses.field(default_factory=dict)
    static: tuple[str, ...] = ()
    extra: Callable[[], dict] = dict


def _janus_with_subspaces(learning_rate: float = 0.1):
    # the bases ride in the state (set as a step would, before the first update)
    tx = optim.with_subspaces(optim.janus(learning_rate))
    return optax.GradientTransformationExtraArgs(
        lambda params: optim.set_subspaces(tx.init(params), _janus_args()["subspaces"]),
        tx.update)


def _balora_after_sgd(min_product_norm: float = 0.0):
    return optax.chain(optax.sgd(0.1), optim.scale_by_balora(min_product_norm=min_product_norm))


def _balora_after_adam(min_product_norm: float = 0.0):
    return optim.balora(optax.adam(1e-2), min_product_norm=min_product_norm)


def _scale_by_crispedit(unmatched: str = "pass"):
    return crispedit_module.scale_by_crispedit(_projector(), unmatched=unmatched)


def _crispedit(learning_rate, order: str = "strict", b1: float = 0.9, mu_dtype=None):
    return crispedit_module.crispedit(learning_rate, _projector(), order=order, b1=b1,
                                      mu_dtype=mu_dtype)


def _crispedit_adam(learning_rate, order: str = "strict"):
    return optim.crispedit_adam(_projector(), learning_rate, order=order)


SPECTRON_STATIC = ("ns_steps", "ns_coeffs", "power_iters", "pair_fn", "wd_scale", "exact_norm",
                   "nesterov", "mu_dtype")

def _scale_by_lordo(omega: float = 0.9):  # rank 1 on the tiny 8 x 2 leaf
    return optim.scale_by_lordo(1, omega=omega, min_dim_for_lowrank=2)


def _lordo(learning_rate):
    return optim.lordo(learning_rate, 1, min_dim_for_lowrank=2)

CASES: dict[str, Case] = {
    "scale_by_spectron": Case(optim.scale_by_spectron, _factor_tree, {"momentum": 0.9},
                              SPECTRON_STATIC),
    "spectron": Case(optim.spectron, _factor_tree, {"learning_rate": 0.05}, SPECTRON_STATIC),
    "spectron_with_adamw": Case(optim.spectron_with_adamw, _factor_and_norm_tree,
                                {"eta": 0.05, "adamw_lr": 1e-2},
                                SPECTRON_STATIC + ("b1", "b2", "clip_norm")),
    "scale_by_balora": Case(_balora_after_sgd, _lora_tree, {"min_product_norm": 1e-6}),
    "balora": Case(_balora_after_adam, _lora_tree, {"min_product_norm": 1e-6}),
    "scale_by_janus": Case(optim.scale_by_janus, _lora_tree, {"scale": 2.0}, ("pair_fn",),
                           _janus_args),
    "janus": Case(optim.janus, _lora_tree, {"learning_rate": 0.1}, ("pair_fn", "mu_dtype"),
                  _janus_args),
    "orthogonality_clamp": Case(optim.orthogonality_clamp, _lora_tree, {"tol": 1e-6},
                                ("pair_fn",), _janus_args),
    "scale_by_input_projection": Case(optim.scale_by_input_projection, _lora_tree, {},
                                      ("pair_fn",), _janus_args),
    "with_subspaces": Case(_janus_with_subspaces, _lora_tree, {"learning_rate": 0.1}),
    "crispedit.scale_by_crispedit": Case(_scale_by_crispedit, _kernel_tree, {}, ("unmatched",)),
    "crispedit.crispedit": Case(_crispedit, _kernel_tree, {"learning_rate": 1e-2, "b1": 0.8},
                                ("order", "mu_dtype")),
    "crispedit_adam": Case(_crispedit_adam, _kernel_tree, {"learning_rate": 1e-2}, ("order",)),
    "scale_by_gao": Case(optim.scale_by_gao, _b_tree, {"momentum": 0.9},
                         ("max_norm", "adam", "mu_dtype")),
    "gao": Case(optim.gao, _b_tree, {"learning_rate": 0.1, "momentum": 0.9},
                ("max_norm", "adam", "mu_dtype")),
    # LoRDO: rank 1 on the 8 x 2 leaf (min_dim_for_lowrank lowered for the tiny tree).
    "scale_by_lordo": Case(_scale_by_lordo, _kernel_tree, {"omega": 0.5}),
    "lordo": Case(_lordo, _kernel_tree, {"learning_rate": 1e-2}),
    "outer_average": Case(optim.outer_average, _kernel_tree),
    "outer_nesterov": Case(optim.outer_nesterov, _kernel_tree, {"lr": 0.7, "momentum": 0.9}),
    "scale_by_salaad": Case(optim.scale_by_salaad, _kernel_tree, {}, ("config", "select")),
    "salaad": Case(optim.salaad, _kernel_tree, {"learning_rate": 1e-2}, ("config", "select")),
}
# Some factories are exported under the package name and found first there.
CASE_OF = {"scale_by_crispedit": "crispedit.scale_by_crispedit"}


def _case(name: str) -> Case:
    return CASES[CASE_OF.get(name, name)]


def test_every_exported_transform_has_a_case():
    names = exported_transforms()
    assert len(names) >= 10
    missing = sorted(n for n in names if CASE_OF.get(n, n) not in CASES)
    assert missing == [], (
        f"transforms {missing} are exported by lowrank_jax.optim but have no entry in CASES of "
        "tests/optim/test_common_transforms.py; add one (a tiny tree, its hyperparameters)."
    )
    stale = sorted(set(CASES) - {CASE_OF.get(n, n) for n in names})
    assert stale == [], f"CASES has entries for transforms that are no longer exported: {stale}"


# ----------------------------------------------------------------------------- helpers


def _params(case: Case, dtype=jnp.float32):
    return {ROOT: case.tree(dtype)}


def _grads(params, step):
    return jax.tree.map(lambda x: _normal(100 + step, x.shape, x.dtype) + 0.1 * x, params)


def _run(tx, params, extra, *, steps=2, jit=True):
    """``steps`` updates; returns the list of updates and the states (init included)."""
    init, update = tx.init, tx.update
    if jit:
        init, update = jax.jit(init), jax.jit(update)
    state = init(params)
    states, outs = [state], []
    for step in range(steps):
        out, state = update(_grads(params, step), state, params, **extra)
        params = optax.apply_updates(params, out)
        outs.append(out)
        states.append(state)
    return outs, states


def _assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) > 0
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=rtol, atol=atol)


ALL = sorted(exported_transforms())
# The state/dtype/sharding/hyperparameter checks of a ``scale_by_m`` that the public method
# ``m`` chains (and is checked in the default run) are in the slow tier.
CHAINED = {f"scale_by_{m}" for m in ("balora", "crispedit", "gao", "janus", "lordo", "salaad",
                                     "spectron")}
COMPOSITES = [pytest.param(n, marks=pytest.mark.slow) if n in CHAINED else n for n in ALL]


# ----------------------------------------------------------------------------- the battery


def test_each_chained_scale_by_is_built_into_its_public_method():
    # what lets COMPOSITES leave those checks of a chained scale_by_m to the slow tier
    import inspect

    factories = exported_transforms()
    for name in CHAINED:
        m = name.removeprefix("scale_by_")
        method = factories.get(m) or factories[f"{m}.{m}"]
        assert f"{name}(" in inspect.getsource(method), (name, method)


@pytest.mark.parametrize("name", ALL)
def test_jit_and_no_jit_agree_and_move_the_params(name):
    case = _case(name)
    params = _params(case)
    tx = case.make(**case.hyper)
    jitted, _ = _run(tx, params, case.extra(), jit=True)
    eager, _ = _run(tx, params, case.extra(), jit=False)
    _assert_trees_close(jitted, eager, rtol=1e-4, atol=1e-5)  # SVDs differ in the last bits
    for out in jitted:
        assert jax.tree.structure(out) == jax.tree.structure(params)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(out))
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(jitted[-1]))


@pytest.mark.parametrize("name", COMPOSITES)
def test_inject_hyperparams_changes_nothing(name):
    case = _case(name)
    params = _params(case)
    want, _ = _run(case.make(**case.hyper), params, case.extra())
    injected = optax.inject_hyperparams(case.make, static_args=case.static)(**case.hyper)
    got, states = _run(injected, params, case.extra())
    # traced hyperparameters are not folded into the program as constants are: float32 rounding
    # differs, and Newton-Schulz / power iterations over 3 steps amplify it to ~5e-5 relative
    _assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    assert set(case.hyper) <= set(states[-1].hyperparams)


@pytest.mark.parametrize("name", ALL)
def test_same_inside_chain_and_partition(name):
    case = _case(name)
    params = _params(case)
    want, _ = _run(case.make(**case.hyper), params, case.extra())
    chained, _ = _run(optax.chain(case.make(**case.hyper), optax.identity()), params,
                      case.extra())
    _assert_trees_close(chained, want, rtol=0, atol=0)
    wide = {**params, "other": {"w": jnp.ones((3,))}}
    labels = {ROOT: jax.tree.map(lambda _: "method", params[ROOT]), "other": {"w": "sgd"}}
    tx = optax.partition({"method": case.make(**case.hyper), "sgd": optax.sgd(0.5)}, labels)
    got, _ = _run(tx, wide, case.extra())
    _assert_trees_close([g[ROOT] for g in got], [w[ROOT] for w in want])
    np.testing.assert_allclose(np.asarray(got[0]["other"]["w"]),
                               -0.5 * np.asarray(_grads(wide, 0)["other"]["w"]), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", COMPOSITES)
def test_state_and_update_dtypes_are_stable(name, dtype):
    case = _case(name)
    params = _params(case, dtype)
    outs, states = _run(case.make(**case.hyper), params, case.extra())
    dtypes = [jax.tree.map(lambda x: x.dtype, s) for s in states]
    assert dtypes[1] == dtypes[0] and dtypes[2] == dtypes[0]
    for out in outs:
        assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, params)


@pytest.mark.parametrize("name", COMPOSITES)
def test_sharded_state_keeps_its_sharding(name):
    assert jax.device_count() == 8  # tests/conftest.py simulates 8 CPU devices
    case = _case(name)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    params = _params(case)

    def spec_of(path, _):
        return SPECS[getattr(path[-1], "key", None)]

    specs = jax.tree_util.tree_map_with_path(spec_of, params)
    with jax.set_mesh(mesh):
        put = lambda tree: jax.tree.map(  # noqa: E731
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
        sharded = put(params)
        tx = case.make(**case.hyper)
        state = jax.jit(tx.init)(sharded)
        types0 = jax.tree.map(jax.typeof, state)
        update = jax.jit(tx.update)
        for step in range(2):
            out, state = update(put(_grads(params, step)), state, sharded, **case.extra())
            assert jax.tree.map(jax.typeof, state) == types0
            sharded = optax.apply_updates(sharded, out)
        assert jax.typeof(jax.tree.leaves(out)[0]).sharding.spec == jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, P))[0]
