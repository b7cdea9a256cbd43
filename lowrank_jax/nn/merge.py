"""Merge LoRA / QLoRA adapters into fp (exact) or into a re-quantized base (error reported).

Merging into fp replaces every adapted layer by a dense ``nnx.Linear`` with
``W' = W_base + s A B`` where ``W_base`` is the dequantized base (exactly what the QLoRA forward
used), so the merged model computes the same function up to fp32 rounding. Merging into a
quantized base re-quantizes ``W'`` with the base's own method and settings (RTN bits and group,
NF4 block and double quant, UniSVQ lattice — without calibration Hessians, i.e. nearest
codeword): that rounding changes the function, and :func:`merge_adapters` returns by how much per
layer; :func:`merge_report` adds the perplexity before and after.

.. math:: \\varepsilon_\\ell = \\frac{\\|Q(W_\\ell + s A B) - (W_\\ell + s A B)\\|_F}
          {\\|W_\\ell + s A B\\|_F}

References:
    Dettmers et al, `QLoRA <https://arxiv.org/abs/2305.14314>`_, 2023 (§ on merging).
"""

from __future__ import annotations

import copy
from typing import Callable, Literal

import jax.numpy as jnp
from flax import nnx

from lowrank_jax.nn.inject import LINEAR_LIKE, lora_layers
from lowrank_jax.nn.lora import LoRAProjection
from lowrank_jax.nn.projection import DenseProjection, set_child, set_kernel_from_matrix

Target = Literal["fp", "quantized"]


def _dense_of(layer) -> jnp.ndarray:
    """``[out, in]`` base weight of an adapted layer (dense kernel or dequantized codes)."""
    if hasattr(layer, "base_weight"):
        return layer.base_weight().astype(jnp.float32)
    return layer.kernel[...].astype(jnp.float32).T


def merge_adapters(model: nnx.Module, *, target: Target = "fp") -> dict[str, float]:
    """Replace every adapted layer of ``model`` (in place) by its merged form.

    Args:
        model: an NNX model with unmerged :class:`~lowrank_jax.nn.LoRALinear` /
            :class:`~lowrank_jax.nn.qlora.QLoRALinear` layers.
        target: ``"fp"`` — a dense fp32 ``nnx.Linear`` holding ``W + s A B`` (exact);
            ``"quantized"`` — the base's quantizer applied to ``W + s A B`` (for a dense base
            this is the same as ``"fp"``).

    Returns:
        ``{path: relative Frobenius error added by re-quantization}`` (0.0 for fp merges).

    Example::

        >>> import jax
        >>> from flax import nnx
        >>> from lowrank_jax.nn import apply_lora
        >>> from lowrank_jax.quant.nf4 import NF4Linear, nf4_quantize
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.up = NF4Linear(nf4_quantize(jax.random.normal(jax.random.PRNGKey(0),
        ...                                                            (8, 64))))
        >>> m = M(); _ = apply_lora(m, {"up": 2}, rngs=nnx.Rngs(0))
        >>> merge_adapters(m, target="fp")
        {'up': 0.0}
    """
    if target not in ("fp", "quantized"):
        raise ValueError(f"merge_adapters: target={target!r}; use 'fp' or 'quantized'.")
    layers = lora_layers(model)
    if not layers:
        raise ValueError("merge_adapters: the model has no adapter; add one with apply_lora or "
                         "import_peft first.")
    merged = [p for p, m in layers if m.merged]
    if merged:
        raise ValueError(f"merge_adapters: {merged[:4]} are already merged in place; call "
                         "lowrank_jax.nn.unmerge_lora(model) first.")
    paths = {p: path for path, m in nnx.iter_modules(model)
             for p in ["/".join(str(x) for x in path)]}
    errors = {}
    for name, layer in layers:
        w = _dense_of(layer) + layer.delta().astype(jnp.float32).T  # [out, in]
        if isinstance(layer, LoRAProjection):
            new, errors[name] = _merged_projection(layer, w, target)
            set_child(model, paths[name], new)
            continue
        base = getattr(layer, "base", None)
        entry = LINEAR_LIKE.get(type(base)) if base is not None else None
        if target == "quantized" and entry is not None:
            new = entry.requantize(base, w)
            w_hat = entry.dense(new)
            errors[name] = float(jnp.linalg.norm(w_hat - w) / jnp.maximum(jnp.linalg.norm(w),
                                                                          1e-30))
        else:
            bias = getattr(layer, "bias", None)
            new = nnx.Linear(layer.in_features, layer.out_features, use_bias=bias is not None,
                             rngs=nnx.Rngs(0))
            new.kernel = nnx.Param(w.T)
            if bias is not None:
                new.bias = bias
            errors[name] = 0.0
        set_child(model, paths[name], new)
    return errors


def _merged_projection(layer, w, target):
    """The merged module of a :class:`LoRAProjection` holding ``w`` ``[out, in]``, and the
    re-quantization error."""
    base = layer.base
    if not hasattr(base, "dense_matrix"):  # a dense base keeps its own type
        set_kernel_from_matrix(base, w.T)
        return base, 0.0
    if target == "quantized":
        new = base.requantized(w)
        w_hat = new.dense_matrix().T
        return new, float(jnp.linalg.norm(w_hat - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30))
    bias = None if base.bias is None else base.bias[...]
    return DenseProjection(base.view.equation, base.view.matrix_kernel(w.T), bias), 0.0


def merge_report(
    model: nnx.Module,
    evaluate: Callable[[nnx.Module], float],
    *,
    target: Target = "quantized",
) -> tuple[nnx.Module, dict]:
    """Merge a copy of ``model`` and measure what merging changed.

    Args:
        model: the adapted model (left untouched).
        evaluate: ``model -> perplexity`` (e.g. ``lambda m: perplexity(m, ids).perplexity``).
        target: as :func:`merge_adapters`.

    Returns:
        ``(merged_model, report)`` with ``report = {"target", "ppl_adapter", "ppl_merged",
        "ppl_added", "layer_error_mean", "layer_error_max", "layers"}``: ``ppl_adapter`` is the
        unmerged adapter on its base, ``ppl_merged`` the merged model, ``ppl_added`` their
        difference (the error merging adds).
    """
    before = float(evaluate(model))
    merged = copy.deepcopy(model)
    errors = merge_adapters(merged, target=target)
    after = float(evaluate(merged))
    values = list(errors.values())
    report = {
        "target": target, "ppl_adapter": before, "ppl_merged": after,
        "ppl_added": after - before,
        "layer_error_mean": sum(values) / len(values), "layer_error_max": max(values),
        "layers": len(values),
    }
    return merged, report


def dequantize_model(model: nnx.Module) -> int:
    """Replace every quantized projection not under an adapter by a dense fp32 ``nnx.Linear``
    holding its dequantized weight (in place) — the base HF / PEFT see; returns the count."""
    found = [(path, m) for path, m in nnx.iter_modules(model)
             if type(m) in LINEAR_LIKE and "base" not in [str(p) for p in path]]
    for path, m in found:
        w = LINEAR_LIKE[type(m)].dense(m).astype(jnp.float32)
        new = nnx.Linear(m.in_features, m.out_features, use_bias=False, rngs=nnx.Rngs(0))
        new.kernel = nnx.Param(w.T)
        set_child(model, path, new)
    return len(found)


__all__ = ["dequantize_model", "merge_adapters", "merge_report"]
