"""LoRA-side checks that run inside the multi-process pretraining test (one process start-up).

Used two ways:

- as the program of each launched process: ``python lora_checks.py OUT -- pretrain ARGS``
  joins the other processes, fine-tunes LoRA with the ``finetune`` command on a
  ``data=2,fsdp=4`` mesh (PEFT export and ``--save-merged`` from the sharded run), takes one
  optimizer step of BaLoRA, Janus and CrispEdit on the sharded model (:func:`optimizer_checks`),
  then runs the ``pretrain`` command with ARGS in the same process;
- imported by the test, which computes the same in one process of 8 devices (the reference).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

FINETUNE = ["finetune", "--model", "tiny", "--mesh", "data=2,fsdp=4", "--steps", "3",
            "--batch-size", "8", "--seq-len", "16", "--rank", "4", "--no-progress"]
PROTECTED = "layers/0/self_attn/q_proj"  # Janus: a protected input subspace of this layer
EDITED = ("layers/0/mlp/down_proj", "layers/1/self_attn/q_proj")  # CrispEdit: row/column layers


def finetune_argv(out: str) -> list[str]:
    return FINETUNE + ["--out", os.path.join(out, "lora"),
                       "--save-merged", os.path.join(out, "merged")]


def _key(path) -> str:
    from lowrank_jax.optim.factors import normalize_path, path_str

    return path_str(normalize_path(path))


def rule_violations(state, params, mesh) -> tuple[int, list[str]]:
    """``(leaves checked against a rule, problems)`` for an optimizer ``state`` of ``params``.

    A state leaf that mirrors a parameter (its path ends with the parameter's path, same shape)
    must have the sharding the rules of :mod:`lowrank_jax.train.sharding` give that parameter;
    every other array must be on ``mesh`` too (a step jitted over several processes needs it).
    """
    from lowrank_jax.train import sharding as shard_lib

    rules = {_key(p): (x.shape, NamedSharding(mesh, shard_lib.logical_spec(p, x.shape)))
             for p, x in jax.tree_util.tree_leaves_with_path(params)}
    checked, problems = 0, []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(leaf, jax.Array):
            continue
        key = _key(path)
        if not (isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh):
            problems.append(f"{key}: {leaf.sharding} is not on the mesh")
            continue
        match = [k for k in rules if (key == k or key.endswith("/" + k))
                 and rules[k][0] == leaf.shape]
        if match:
            checked += 1
            want = rules[max(match, key=len)][1]
            if not want.is_equivalent_to(leaf.sharding, leaf.ndim):
                problems.append(f"{key}: {leaf.sharding.spec}, the rules say {want.spec}")
    return checked, problems


def _model(mesh):
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.nn import LoRARule, apply_lora, lora_layers
    from lowrank_jax.train import sharding as shard_lib

    model = preset_model("tiny")
    apply_lora(model, LoRARule(r"(q|v)_proj", rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    # B = 0 at init; give it values so that the balancing and rectification have work to do
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(i), layer.lora_b.shape)
    shard_lib.shard_model(model, mesh)
    return model


def _crispedit_projector(params):
    from lowrank_jax.curvature.kfac import KFACFactor
    from lowrank_jax.optim.crispedit import build_projector

    shapes = {_key(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    factors = {}
    for layer in EDITED:
        d_in, d_out = shapes[f"{layer}/kernel"]
        factors[layer] = KFACFactor(jnp.diag(jnp.linspace(4.0, 0.1, d_in)),
                                    jnp.diag(jnp.linspace(2.0, 0.5, d_out)), jnp.array(1.0))
    return build_projector(factors, energy=0.5)


def _direct_export_error(model) -> str:
    """What ``export_peft`` says about a model sharded over processes ("" in one process)."""
    import tempfile

    from lowrank_jax.io.peft import export_peft

    if jax.process_count() == 1:
        return ""
    try:
        export_peft(model, tempfile.mkdtemp())
    except ValueError as error:
        return str(error)
    return "no error"


def optimizer_checks(mesh) -> dict:
    """One step of BaLoRA, Janus and CrispEdit on the sharded tiny model.

    The state from ``init`` must follow the rules; the step runs with the state's shardings as
    out shardings (as :mod:`lowrank_jax.train` compiles its steps; without them XLA's
    propagation may replicate a moment on an Auto mesh, e.g. Janus' rectified ``lora_b``).
    Returns ``{name: {"init_checked", "checked", "problems", "updates"}}`` with the updates
    gathered to numpy (collective: every process calls this), and ``"export_error"``: what
    ``export_peft`` says about the sharded model.
    """
    from lowrank_jax import optim
    from lowrank_jax.train import multihost
    from lowrank_jax.train import sharding as shard_lib

    model = _model(mesh)
    results = {"export_error": _direct_export_error(model)}
    lora = nnx.state(model, nnx.LoRAParam)
    kernels = {}  # the edited kernels, as {"layers": {0: {"mlp": {"down_proj": {...}}}}}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        key = _key(path)
        if key.rsplit("/", 1)[0] in EDITED and key.endswith("/kernel"):
            node = kernels
            for name in key.split("/")[:-1]:
                node = node.setdefault(name, {})
            node["kernel"] = leaf
    d_model = model.cfg.d_model
    basis = jnp.eye(d_model, 3)  # protect the first three input directions
    cases = {
        "balora": (optim.balora(optax.adamw(1e-2)), lora, {}),
        "janus": (optim.janus(1e-2, scale=2.0), lora, {"subspaces": {PROTECTED: basis}}),
        "crispedit": (optim.crispedit_adam(_crispedit_projector(kernels), 1e-2), kernels, {}),
    }
    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    for name, (tx, params, extra) in cases.items():
        state = shard_lib.init_optimizer_state(tx, params, mesh)
        init_checked, init_problems = rule_violations(state, params, mesh)
        grads = jax.tree.map(lambda p: jnp.sin(3.0 * p) + 0.05, params)
        # as the library's steps do: the state's shardings pinned as the step's out shardings
        step = jax.jit(tx.update, out_shardings=(sharding_of(params), sharding_of(state)))
        updates, new_state = step(grads, state, params, **extra)
        checked, problems = rule_violations(new_state, params, mesh)
        results[name] = {
            "checked": checked, "problems": init_problems + problems,
            "init_checked": init_checked,
            "updates": {_key(p): x for p, x in
                        jax.tree_util.tree_leaves_with_path(multihost.gather_to_host(updates))},
        }
    return results


def main(argv: list[str]) -> int:
    from lowrank_jax.cli import main as cli_main
    from lowrank_jax.train import multihost
    from lowrank_jax.train import sharding as shard_lib

    out, rest = argv[0], argv[argv.index("--") + 1:]
    shard_lib.maybe_initialize_distributed()
    status = cli_main(finetune_argv(out))
    if status:
        return status
    results = optimizer_checks(shard_lib.make_mesh(2, 4))
    if multihost.is_main_process():
        export_error = results.pop("export_error")
        np.savez(os.path.join(out, "updates.npz"), **{
            f"{name}:{key}": value for name, r in results.items()
            for key, value in r["updates"].items()})
        with open(os.path.join(out, "optimizer_checks.json"), "w") as f:
            json.dump({"export_error": export_error} | {
                name: {k: v for k, v in r.items() if k != "updates"}
                for name, r in results.items()}, f)
    return cli_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
