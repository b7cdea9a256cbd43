"""Structure grown during pretraining (``--set structure=salaad``) and its export.

``structure=salaad`` puts :func:`lowrank_jax.optim.scale_by_salaad` in front of the run's
optimizer: the augmented-Lagrangian pull ``ρ(X − L − S + Y/ρ)`` is added to the gradient of every
2-D weight before clipping, and the ADMM block (SVT for ``L``, soft-thresholding for ``S``, the
rank / density controllers, the dual step) runs every ``salaad.every`` steps. The
:class:`~lowrank_jax.optim.SalaadState` lives inside the optax state, so the run's orbax
checkpoints hold it with the rest and ``--resume`` continues it bit-identically.

:func:`export_salaad` then turns one such run into a model at any parameter budget
(``lowrank-jax export --run RUN --budget 0.5 --out DIR``) with the HPA allocator of
:mod:`lowrank_jax.optim.salaad_deploy`.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import numpy as np

from lowrank_jax.models.tokenizer import BYTE_TOKENIZER_FILE
from lowrank_jax.optim.salaad import find_salaad_state, salaad_stats
from lowrank_jax.train.optimizers import with_structure  # noqa: F401 (its home: beside the optimizers)

FACTORS_FILE = "salaad_factors.npz"  # not *.safetensors: the HF loader reads those
REPORT_FILE = "salaad.json"
EXPORT_FILES = ("config.json", "model.safetensors", FACTORS_FILE, REPORT_FILE,
                BYTE_TOKENIZER_FILE)


def load_run(run_dir, *, log=print):
    """``(cfg, state)`` of the newest good checkpoint of a ``pretrain`` run folder.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.yaml`` or no checkpoint.
    """
    from lowrank_jax.io.checkpoint import checkpoint_manager, restore_checkpoint
    from lowrank_jax.train.config import load_config
    from lowrank_jax.train.loop import init_state

    run_dir = pathlib.Path(run_dir)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(
            f"run_dir={run_dir}: no config.yaml; pass the run_dir of a `lowrank-jax pretrain` "
            "run.")
    cfg = load_config(str(config))
    if not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(f"run_dir={run_dir}: no checkpoints/ folder; the run saved no "
                                "checkpoint yet.")
    state, _ = init_state(cfg)
    manager = checkpoint_manager(run_dir, create=False)
    try:
        state, manager = restore_checkpoint(manager, state, cfg, log=log)
    finally:
        manager.close()
    return cfg, state


def _param_tree(state) -> dict:
    from lowrank_jax.optim.factors import normalize_path

    return {normalize_path(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def export_salaad(run_dir, budget: float, out, *, gamma: float = 0.5, overwrite: bool = False,
                  log=print) -> dict:
    """Write the SALAAD surrogate of a run at ``budget`` × its parameters to ``out``.

    The folder is a HF ``LlamaForCausalLM`` folder (written by
    :func:`lowrank_jax.hub.save_model`) whose selected weights are the dense surrogates
    ``L̃ + S̃``, so ``eval`` / ``generate`` / ``hub.load_model`` read it; beside it,
    ``salaad_factors.npz`` stores the structured form that the parameter count refers
    to (per weight ``<path>.left`` = ``U√σ``, ``<path>.right`` = ``√σVᵀ``, ``<path>.rows`` /
    ``.cols`` / ``.values`` = the kept entries of ``S̃``), and ``salaad.json`` the report. The
    byte-level pretrain model has no ``tokenizer.json``: the folder gets
    ``byte_tokenizer.json`` and the commands read its text as bytes.

    Args:
        run_dir: a ``pretrain`` run trained with ``--set structure=salaad``.
        budget: fraction of the dense parameter count, in ``(0, 1]``.
        out: output folder.
        gamma: fraction of the reduction taken from the low-rank parts (HPA's ``γ``).
        overwrite: write into a non-empty folder (see
            :func:`lowrank_jax.runs.outputs.prepare_output`).

    Returns:
        The report dict (also ``out/salaad.json``).
    """
    from flax import nnx

    from lowrank_jax.runs.outputs import atomic_write_text, prepare_output, staged_folder
    from lowrank_jax.hub import save_model
    from lowrank_jax.optim.salaad_deploy import apply_surrogate, hpa_allocate, hpa_materialize

    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and 0 < budget <= 1):
        raise ValueError(f"budget={budget}: must be a fraction of the parameters in (0, 1], "
                         "e.g. 0.5.")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma}: must lie in [0, 1] (the share of the reduction "
                         "taken from the low-rank parts).")
    cfg, state = load_run(run_dir, log=log)
    if cfg.structure != "salaad":
        raise ValueError(
            f"run_dir={run_dir}: the run was trained with structure={cfg.structure!r}, so it has "
            "no SALAAD state; pretrain with the overrides structure=salaad and "
            "model.projection=dense to export budgets.")
    sstate = find_salaad_state(state.opt_state)
    n_total = sum(int(x.size) for x in jax.tree.leaves(state.params))
    target = int(math.floor(budget * n_total))
    allocation = hpa_allocate(sstate, n_total, target, gamma=gamma)
    if allocation.n_params > target:
        raise ValueError(
            f"budget={budget}: {target:,} parameters cannot hold the weights SALAAD does not "
            f"decompose (norms, ...); the smallest model has {allocation.n_params:,}; raise "
            "`budget`.")
    folder = prepare_output(out, command="export", overwrite=overwrite, owned_names=EXPORT_FILES)
    surrogate = apply_surrogate(state.params, sstate, allocation)
    tensors = {}
    for path, (left, right, (rows, cols, values)) in hpa_materialize(sstate,
                                                                      allocation).items():
        name = "/".join(map(str, path))
        tensors.update({f"{name}.left": np.ascontiguousarray(left, np.float32),
                        f"{name}.right": np.ascontiguousarray(right, np.float32),
                        f"{name}.rows": np.asarray(rows, np.int32),
                        f"{name}.cols": np.asarray(cols, np.int32),
                        f"{name}.values": np.asarray(values, np.float32)})
    stats = salaad_stats(state.params, sstate)
    weights = _param_tree(state.params)
    report = {
        "run": str(run_dir), "step": int(state.step), "budget": budget, "gamma": gamma,
        "dense_params": n_total, "target_params": target, "params": allocation.n_params,
        "rest_params": n_total - sum(int(weights[p].size) for p in allocation.ranks),
        "layers": {"/".join(map(str, p)): {"rank": allocation.ranks[p],
                                           "nnz": allocation.nnz[p],
                                           **stats.get("/".join(map(str, p)), {})}
                   for p in allocation.ranks},
    }
    with staged_folder(folder) as stage:  # all or nothing: a failure leaves no half model
        save_model(nnx.merge(state.graphdef, surrogate), stage)
        with open(stage / FACTORS_FILE, "wb") as f:
            np.savez(f, **tensors)
        atomic_write_text(stage / REPORT_FILE, json.dumps(report, indent=1))
        if cfg.model.vocab_size == 256:
            atomic_write_text(stage / BYTE_TOKENIZER_FILE,
                              json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
    log(f"SALAAD model at {budget:.0%} of {n_total:,} parameters: {allocation.n_params:,} "
        f"(target {target:,}) in {folder}")
    return report


def structured_param_count(folder) -> int:
    """Parameters of an exported folder's structured form: every weight not in
    ``salaad_factors.npz`` at full size, plus the factors and the kept sparse values
    (indices are storage, not parameters)."""
    folder = pathlib.Path(folder)
    report = json.loads((folder / REPORT_FILE).read_text())
    with np.load(folder / FACTORS_FILE) as factors:
        kept = sum(int(factors[k].size) for k in factors.files
                   if k.endswith((".left", ".right", ".values")))
    return int(report["rest_params"]) + kept


__all__ = ["BYTE_TOKENIZER_FILE", "FACTORS_FILE", "REPORT_FILE", "export_salaad", "load_run",
           "structured_param_count", "with_structure"]
