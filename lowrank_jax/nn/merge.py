"""Merge LoRA / QLoRA adapters into fp (exact) or into a re-quantized base (error reported).

One merge for every adapted layer (:func:`merge_adapters`, used by
:func:`~lowrank_jax.nn.remove_lora`, ``save_merged`` and :func:`lowrank_jax.hub.save_model`). A
dense base takes ``W' = W + s A B`` into its own kernel (dtype, layout and sharding kept) and
comes back as the module it was. Merging a quantized base into fp gives a dense fp32 module with
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

from lowrank_jax.nn.lora import LoRALinear, LoRAProjection, lora_layers
from lowrank_jax.nn.projection import (
    DenseProjection,
    dense_matrix,
    kernel_axis_names,
    module_path,
    new_param,
    projection_type,
    projection_view,
    set_child,
)

_Target = Literal["fp", "quantized"]
LINEAR_EQUATION = "...i,io->...o"


def unwrap(layer) -> nnx.Module:
    """The module an adapted layer replaced, its adapter dropped as it is (a merged-in-place
    adapter stays in the kernel): an ``nnx.Linear`` sharing the :class:`LoRALinear`'s kernel
    and bias (its dtype, precision and sharding), or the base of any other adapted layer."""
    if not isinstance(layer, LoRALinear):
        return layer.base
    bias = layer.bias
    linear = nnx.eval_shape(lambda: nnx.Linear(
        layer.in_features, layer.out_features, use_bias=bias is not None, dtype=layer.dtype,
        param_dtype=layer.param_dtype, precision=layer.precision, rngs=nnx.Rngs(0)))
    linear.kernel = layer.kernel
    linear.bias = bias
    return linear


def _dense_module(base, matrix) -> nnx.Module:
    """A dense module holding ``matrix`` ``[in, out]`` (fp32) in place of the frozen ``base``:
    an ``nnx.Linear`` for a linear layout, else a :class:`DenseProjection` that keeps the
    original projection's public attributes."""
    view = projection_view(base)
    axes = kernel_axis_names(base)
    bias = projection_type(base).bias
    bias = None if bias is None else getattr(base, bias, None)
    bias = None if bias is None else bias[...]
    if view.equation == LINEAR_EQUATION:
        linear = nnx.eval_shape(lambda: nnx.Linear(view.in_features, view.out_features,
                                                   use_bias=bias is not None, rngs=nnx.Rngs(0)))
        linear.kernel = new_param(nnx.Param, jnp.asarray(matrix, jnp.float32), axes)
        if bias is not None:
            linear.bias = nnx.Param(jnp.asarray(bias, jnp.float32))
        return linear
    return DenseProjection(view.equation, view.to_kernel(jnp.asarray(matrix, jnp.float32)),
                           bias, replaced_attributes=getattr(base, "replaced_attributes", ()),
                           replaced_type=getattr(base, "replaced_type", None), kernel_axes=axes)


def _relative_error(approx, exact) -> float:
    return float(jnp.linalg.norm(approx - exact) / jnp.maximum(jnp.linalg.norm(exact), 1e-30))


def merged_module(layer, target: _Target = "fp") -> tuple[nnx.Module, float]:
    """The merged form of one adapted layer and the error re-quantization added.

    A dense base takes ``W + s A B`` in place (its kernel keeps its dtype, layout and sharding)
    and comes back as the module it was (an ``nnx.Linear``, the user's einsum module...). A
    base without a dense kernel (quantized) becomes a dense fp32 module holding
    ``dequant(W) + s A B`` (``target="fp"``, exact) or its own kind re-quantized from it
    (``target="quantized"``, the error returned)."""
    base = layer.base if isinstance(layer, LoRAProjection) else None
    if base is None or not projection_type(base).frozen:
        if not layer.merged:
            layer.merge()
        return unwrap(layer), 0.0
    w = layer.dense_matrix() + layer.delta().astype(jnp.float32)  # [in, out]
    if target == "fp":
        return _dense_module(base, w), 0.0
    requantize = projection_type(base).requantize
    if requantize is None:
        raise ValueError(f"merge_adapters: a {type(base).__name__} base cannot be re-quantized "
                         "(it registered no requantize); merge with target='fp'.")
    new = requantize(base, w)
    return new, _relative_error(jnp.asarray(dense_matrix(new), jnp.float32), w)


def merge_adapters(model: nnx.Module, *, target: _Target = "fp") -> dict[str, float]:
    """Replace every adapted layer of ``model`` (in place) by its merged form: the one merge,
    used by :func:`~lowrank_jax.nn.remove_lora`, ``save_merged`` and
    :func:`lowrank_jax.hub.save_model`.

    Args:
        model: an NNX model with :class:`~lowrank_jax.nn.LoRALinear`,
            :class:`~lowrank_jax.nn.LoRAProjection` or :class:`~lowrank_jax.nn.QLoRALinear`
            layers (merged in place or not).
        target: for a quantized base, ``"fp"`` — a dense fp32 module holding ``W + s A B``
            (exact) — or ``"quantized"`` — the base's quantizer applied to ``W + s A B``. A dense
            base always takes ``W + s A B`` into its own kernel (dtype and sharding kept).

    Returns:
        ``{path: relative Frobenius error added by re-quantization}`` (0.0 for exact merges).

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
        >>> merge_adapters(m, target="fp"), type(m.up).__name__
        ({'up': 0.0}, 'Linear')
    """
    if target not in ("fp", "quantized"):
        raise ValueError(f"merge_adapters: target={target!r}; use 'fp' or 'quantized'.")
    layers = lora_layers(model)
    if not layers:
        raise ValueError("merge_adapters: the model has no adapter; add one with apply_lora or "
                         "import_peft first.")
    paths = {module_path(path): path for path, _ in nnx.iter_modules(model)}
    errors = {}
    for name, layer in layers:
        new, errors[name] = merged_module(layer, target)
        set_child(model, paths[name], new)
    return errors


def merge_report(
    model: nnx.Module,
    evaluate: Callable[[nnx.Module], float],
    *,
    target: _Target = "quantized",
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
    """Replace every quantized projection not under an adapter by a dense fp32 module holding
    its dequantized weight (in place) — the base HF / PEFT see; returns the count."""
    found = [(p, m) for p, m in nnx.iter_modules(model)
             if isinstance(m, (LoRALinear, LoRAProjection))
             or (projection_type(m) is not None and projection_type(m).frozen)]
    outer = {p for p, _ in found}
    found = [(p, m) for p, m in found if not isinstance(m, (LoRALinear, LoRAProjection))
             and not any(p[:i] in outer for i in range(len(p)))]
    for path, m in found:
        set_child(model, path, _dense_module(m, jnp.asarray(dense_matrix(m), jnp.float32)))
    return len(found)


__all__ = ["dequantize_model", "merge_adapters", "merge_report", "merged_module", "unwrap"]
