"""Export / import LoRA adapters in HuggingFace PEFT's on-disk format (no torch needed).

PEFT stores an adapter as ``adapter_config.json`` plus ``adapter_model.safetensors`` whose keys
are ``base_model.model.<hf module name>.lora_A.weight`` (shape ``[r, in]``) and
``...lora_B.weight`` (shape ``[out, r]``, torch layout ``W = [out, in]``). For
``LlamaForCausalLM`` the module names are ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``model.layers.{i}.mlp.{gate,up,down}_proj`` and ``lm_head``. Our
:class:`~lowrank_jax.nn.LoRALinear` keeps ``lora_a`` ``[in, r]`` and ``lora_b`` ``[r, out]``,
so export is a transpose and import the reverse.

References:
    HuggingFace PEFT checkpoint format,
    https://huggingface.co/docs/peft/developer_guides/checkpoint ; Hu et al,
    `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.io.adapters import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    pattern_value,
    read_adapter,
    read_adapter_config,
)
from lowrank_jax.runs.outputs import staged_folder
from lowrank_jax.io.peft_layout import export_modules, import_modules, model_slots
from lowrank_jax.io.peft_names import (
    HF_DECODER_MAP,
    NAME_MAPS,
    hf_module_name,
    name_mapper,
    our_module_path,
)
from lowrank_jax.nn.inject import (
    LoRARule,
    apply_lora,
    expert_kernels,
    lora_layers,
)
from lowrank_jax.nn.lora import LoRALinear, lora_scaling
from lowrank_jax.nn.projection import module_path, outermost_projections, projection_view

PEFT_PREFIX = "base_model.model."


def _default_map(model: nnx.Module, name_map: Any) -> Any:
    """``name_map``, or for our Llama built for a family with fused modules (``cfg.family ==
    "phi3"``) that family's map."""
    if name_map is None and getattr(getattr(model, "cfg", None), "family", None) == "phi3":
        return "phi3"
    return name_map


def _slots(model: nnx.Module, name_map: Any, adapted: set[str]):
    """The name map's view of every projection of ``model``, adapted or not."""
    modules = [(p, m) for p, m in lora_layers(model)]
    modules += [(module_path(p), m) for p, m in outermost_projections(model)]
    return model_slots(modules, name_mapper(name_map), adapted)


def _target_modules(names: set[str], slots) -> Any:
    r"""PEFT's ``target_modules`` for the exported HF module ``names``: their short names when
    every module of the model with such a short name is exported, else a regex that fully
    matches exactly ``names`` (PEFT ``re.fullmatch``\ es a string)."""
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    every = {t.name for slot in slots.values() for t in slot.targets} | names
    if all(n in names for n in every if n.rsplit(".", 1)[-1] in short):
        return short
    return "|".join(re.escape(n) for n in sorted(names))


def _effective_alpha(layer: LoRALinear) -> float:
    return float(layer.rank if layer.alpha is None else layer.alpha)


def _number(x: float):
    return int(x) if float(x).is_integer() else float(x)


def export_peft(
    model: nnx.Module,
    folder: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    initial_adapters: Mapping[str, tuple[Any, Any]] | None = None,
    task_type: str = "CAUSAL_LM",
    dtype: Any = np.float32,
    name_map: Any = None,
) -> dict:
    """Write every :class:`LoRALinear` adapter of ``model`` as a PEFT LoRA adapter folder.

    .. math:: \\texttt{lora\\_A.weight} = A^\\top\\ [r, in],\\qquad
              \\texttt{lora\\_B.weight} = B^\\top\\ [out, r]

    The config carries ``peft_type="LORA"``, ``task_type``, ``r`` and ``lora_alpha`` (the most
    common values), ``rank_pattern`` / ``alpha_pattern`` keyed by HF module name for modules
    that differ, ``use_rslora``, ``use_dora=false`` and ``target_modules``: the list of short HF
    names when every module of the model with such a name is adapted, else a regex that fully
    matches exactly the adapted HF module names (PEFT ``re.fullmatch``es a string
    ``target_modules``).

    PiSSA / OLoRA adapters change the base kernel; pass ``initial_adapters={path: (A0, B0)}``
    (the adapter right after initialisation) to export PEFT's conversion to a plain LoRA on the
    *original* base weights: ``A' = [A, A0]``, ``B' = [B; −B0]`` with rank ``2r`` and alpha
    doubled (``√2·alpha`` with rsLoRA) so that the scale is unchanged.

    Args:
        model: an NNX model with (unmerged) :class:`LoRALinear` layers, module names as HF's
            ``LlamaForCausalLM`` (:class:`~lowrank_jax.models.Llama`).
        folder: output directory (created).
        base_model_name_or_path: written to the config (e.g.
            ``"HuggingFaceTB/SmolLM2-135M-Instruct"``) for ``PeftModel.from_pretrained``.
        initial_adapters: optional ``{path: (A0 [in, r], B0 [r, out])}`` for PiSSA/OLoRA.
        task_type: PEFT task type (``"CAUSAL_LM"``).
        dtype: numpy dtype of the stored tensors (float32 default; bfloat16 via ml_dtypes).
        name_map: how module paths become HF module names (see
            ``lowrank_jax.io.peft_names``): default our Llama's (Phi-3's fused names when its
            ``cfg.family`` is ``"phi3"``); ``"llama"`` / ``"qwen"`` /
            ``"gemma"`` / ``"mistral"`` / ``"hf"`` for a model named as HF, tunix, gemma or
            MaxText name their projections; ``"phi3"`` for Phi-3's fused ``qkv_proj`` /
            ``gate_up_proj``; a function or a ``{regex: target}`` mapping otherwise. The keys,
            ``target_modules`` and ``rank_pattern`` / ``alpha_pattern`` all use the mapped
            names. Adapters of multi-dimensional kernels (``[D, N, H]``) are stored flattened
            over their grouped axes, the ``[out, in]`` layout of the equivalent HF ``Linear``;
            a fused kernel (``kv_einsum``) is split over its HF modules or stored on the fused
            one, and separate adapters stacked onto a fused module
            (``lowrank_jax.io.peft_layout``); a fused kernel mapped to one plain HF name is
            refused.

    Returns:
        The config dict that was written.

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> from lowrank_jax.nn import apply_lora
        >>> model = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32),
        ...               rngs=nnx.Rngs(0))
        >>> _ = apply_lora(model, {"q_proj": 2}, rngs=nnx.Rngs(1))
        >>> import tempfile
        >>> export_peft(model, tempfile.mkdtemp())["target_modules"]
        ['q_proj']
    """
    from safetensors.numpy import save_file

    name_map = _default_map(model, name_map)
    layers = lora_layers(model)
    if not layers:
        raise ValueError("export_peft: model has no LoRA adapter; add adapters with "
                         "lowrank_jax.nn.apply_lora first.")
    merged = [p for p, m in layers if m.merged]
    if merged:
        raise ValueError(f"export_peft: adapters {merged[:4]} are merged into their kernels; "
                         "call lowrank_jax.nn.unmerge_lora(model) before exporting.")
    rslora = {m.use_rslora for _, m in layers}
    if len(rslora) != 1:
        raise ValueError("export_peft: layers mix use_rslora=True and False; PEFT needs one value.")
    use_rslora = rslora.pop()
    initial_adapters = dict(initial_adapters or {})
    unknown = sorted(set(initial_adapters) - {p for p, _ in layers})
    if unknown:
        raise ValueError(f"export_peft: initial_adapters names unknown paths {unknown[:4]}; "
                         f"adapted paths: {[p for p, _ in layers][:8]}")
    spread = [p for p, m in layers if not getattr(m.lora_a[...], "is_fully_addressable", True)
              or not getattr(m.lora_b[...], "is_fully_addressable", True)]
    if spread:
        raise ValueError(
            f"export_peft: the adapters of {spread[:2]} are sharded over several processes; "
            "gather them first: lowrank_jax.train.finetune.export_adapter(model, folder) (every "
            "process calls it, process 0 writes) or export_peft("
            "lowrank_jax.train.multihost.host_copy(model), folder) on process 0.")
    adapters = []
    for path, layer in layers:
        a = np.asarray(layer.lora_a[...], np.float32)
        b = np.asarray(layer.lora_b[...], np.float32)
        rank, alpha = layer.rank, _effective_alpha(layer)
        if path in initial_adapters:
            a0, b0 = (np.asarray(t, np.float32) for t in initial_adapters[path])
            if a0.shape != a.shape or b0.shape != b.shape:
                raise ValueError(
                    f"export_peft: initial adapter of {path} has shapes {a0.shape}, {b0.shape}; "
                    f"expected {a.shape}, {b.shape}."
                )
            a, b = np.concatenate([a, a0], axis=1), np.concatenate([b, -b0], axis=0)
            alpha = alpha * (math.sqrt(2.0) if use_rslora else 2.0)
            rank = 2 * rank
        adapters.append((path, a, b, rank, alpha))
    slots = _slots(model, name_map, {p for p, _ in layers})
    tensors, ranks, alphas = {}, {}, {}
    for name, (lora_a, lora_b, rank, alpha) in export_modules(adapters, slots,
                                                               use_rslora).items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(lora_a).astype(dtype)
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(lora_b).astype(dtype)
        ranks[name], alphas[name] = rank, alpha
    r = collections.Counter(ranks.values()).most_common(1)[0][0]
    alpha = collections.Counter(alphas.values()).most_common(1)[0][0]
    target_modules = _target_modules(set(ranks), slots)
    dropouts = {float(m.lora_dropout.rate) if m.lora_dropout is not None else 0.0
                for _, m in layers}
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": int(r),
        "lora_alpha": _number(alpha),
        "lora_dropout": max(dropouts),
        "use_rslora": bool(use_rslora),
        "use_dora": False,
        "target_modules": target_modules,
        "rank_pattern": {k: int(v) for k, v in sorted(ranks.items()) if v != r},
        "alpha_pattern": {k: _number(v) for k, v in sorted(alphas.items()) if v != alpha},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    # written to a temporary folder and renamed: a crash never leaves half an adapter
    with staged_folder(folder) as tmp:
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
        read_adapter(tmp, who="export_peft")  # what every reader checks, before any rename
    return config


def import_peft(model: nnx.Module, folder: str | os.PathLike, *,
                rngs: nnx.Rngs | None = None, name_map: Any = None) -> list[str]:
    """Apply a PEFT LoRA adapter folder to ``model`` (in place); returns the adapted paths.

    Plain ``nnx.Linear`` layers named in the adapter are wrapped in :class:`LoRALinear` with
    the adapter's rank and alpha (``rank_pattern`` / ``alpha_pattern`` honoured); existing
    :class:`LoRALinear` layers must have the same rank and get their factors and scale replaced.

    Args:
        model: an NNX model with HF ``LlamaForCausalLM`` module names.
        folder: a directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
        rngs: keys for wrapping new layers (their random init is overwritten anyway).
        name_map: as :func:`export_peft`; the same map reads the names back (the slices of a
            split fused kernel become one adapter again; a fused HF module's row blocks go to
            the projections the map names as its parts). An adapter of HF expert modules is
            refused by name (see ``lowrank_jax.nn.inject.expert_kernels``).

    Returns:
        The adapted module paths (ours, e.g. ``layers/0/self_attn/q_proj``).

    Raises:
        FileNotFoundError: a file of the adapter folder is missing.
        ValueError: not a LoRA adapter (DoRA unsupported), a module the model does not have
            (the message lists the available ones), or a tensor whose shape does not match.

    Example::

        >>> import tempfile
        >>> from flax import nnx
        >>> from lowrank_jax.models import Llama, LlamaConfig
        >>> from lowrank_jax.nn import apply_lora
        >>> cfg = LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32)
        >>> src = Llama(cfg, rngs=nnx.Rngs(0))
        >>> _ = apply_lora(src, {"v_proj": 2}, rngs=nnx.Rngs(1))
        >>> folder = tempfile.mkdtemp()
        >>> _ = export_peft(src, folder)
        >>> import_peft(Llama(cfg, rngs=nnx.Rngs(0)), folder)
        ['layers/0/self_attn/v_proj']
    """
    name_map = _default_map(model, name_map)
    config, modules = read_adapter(folder, who="import_peft")  # the one adapter check
    for hf_name, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"import_peft: module {hf_name!r} lacks lora_A or lora_B.")
        if pair["lora_A"].ndim != 2 or pair["lora_B"].ndim != 2 or (
                pair["lora_A"].shape[0] != pair["lora_B"].shape[1]):
            raise ValueError(f"import_peft: {hf_name} has lora_A {pair['lora_A'].shape} and "
                             f"lora_B {pair['lora_B'].shape}; expected [r, in] and [out, r].")
    existing = {p: m for p, m in lora_layers(model)}
    slots = _slots(model, name_map, set())
    available = sorted(slots)
    r_default, alpha_default = int(config.get("r", 8)), config.get("lora_alpha", 8)
    use_rslora = bool(config.get("use_rslora", False))
    stored = {}
    for hf_name in sorted(modules):
        a_t, b_t = (np.asarray(modules[hf_name][k], np.float32) for k in ("lora_A", "lora_B"))
        expected_r = int(pattern_value(hf_name, config.get("rank_pattern") or {}, r_default))
        if expected_r != a_t.shape[0]:
            raise ValueError(f"import_peft: {hf_name} stores rank {a_t.shape[0]} but the config "
                             f"says {expected_r}; the adapter folder is inconsistent.")
        alpha = float(pattern_value(hf_name, config.get("alpha_pattern") or {}, alpha_default))
        stored[hf_name] = (a_t, b_t, alpha)
    found, used = import_modules(stored, slots, use_rslora)
    unknown = sorted(set(stored) - used)
    experts = expert_kernels(model)
    if experts and any(".experts." in n for n in unknown):
        shown = ", ".join(f"{p} {list(s)}" for p, s in experts[:3])
        raise ValueError(
            f"import_peft: the adapter adapts experts of an MoE layer ({unknown[0]!r} ...), but "
            f"this model keeps its experts as bare parameters ({shown}) and lowrank_jax has no "
            "LoRA per expert. Train the adapter without the experts (target_modules leaving "
            "them out), or merge it into the base weights first (PEFT merge_and_unload) and "
            "load those.")
    if unknown:
        raise ValueError(
            f"import_peft: the adapter targets module {unknown[0]!r} (our path "
            f"{our_module_path(unknown[0]) if name_map is None else None!r}) which this model "
            f"does not have. Available modules: {', '.join(available)}")
    plan = []
    for path, (a, b, rank, alpha) in found.items():
        layer = existing.get(path) or next(m for p, m in nnx.iter_modules(model)
                                           if module_path(p) == path)
        if hasattr(layer, "in_features") and type(layer) is not nnx.LinearGeneral:
            in_f, out_f = layer.in_features, layer.out_features
        else:  # a projection of any layout: the sizes of its [in, out] matrix view
            view = projection_view(layer)
            in_f, out_f = view.in_features, view.out_features
        if a.shape != (in_f, rank) or b.shape != (rank, out_f):
            names = ", ".join(t.name for t in slots[path].targets)
            raise ValueError(
                f"import_peft: {names} has lora_A {a.T.shape} and lora_B {b.T.shape}; this "
                f"model's layer needs [r, {in_f}] and [{out_f}, r]. Was the adapter trained on "
                "a different base model?"
            )
        if path in existing and existing[path].rank != rank:
            raise ValueError(
                f"import_peft: {path} already has a rank-{existing[path].rank} adapter but the "
                f"PEFT adapter has rank {rank}; remove_lora(model) first or match the rank."
            )
        plan.append((path, rank, alpha, a.T, b.T))
    new = [(path, rank, alpha) for path, rank, alpha, _, _ in plan if path not in existing]
    if new:
        rngs = nnx.Rngs(0) if rngs is None else rngs
        rules = [LoRARule("^" + re.escape(p) + "$", rank=r, alpha=a, use_rslora=use_rslora)
                 for p, r, a in new]
        apply_lora(model, rules, rngs=rngs)
    layers = {p: m for p, m in lora_layers(model)}
    for path, rank, alpha, a_t, b_t in plan:
        layer = layers[path]
        layer.alpha, layer.use_rslora = alpha, use_rslora
        layer.scaling = lora_scaling(rank, alpha, use_rslora)
        layer.lora_a[...] = jnp.asarray(a_t.T, layer.param_dtype)
        layer.lora_b[...] = jnp.asarray(b_t.T, layer.param_dtype)
    return [p for p, *_ in plan]


__all__ = ["CONFIG_NAME", "HF_DECODER_MAP", "NAME_MAPS", "PEFT_PREFIX", "WEIGHTS_NAME",
           "export_peft", "hf_module_name", "import_peft", "name_mapper", "our_module_path",
           "pattern_value", "read_adapter_config"]
