"""Quantize the projections of any NNX model for QLoRA: :func:`quantize_projections`.

Each matched projection (``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, a user's einsum
module: see :mod:`lowrank_jax.nn.projection`) becomes a :class:`QuantizedProjection` — the
matrix view's weight held by a quantized linear (NF4 or RTN 4-bit) — that keeps the original's
layout and public attributes. Then :func:`lowrank_jax.nn.apply_lora` puts a
:class:`~lowrank_jax.nn.QLoRALinear` on it and :func:`lowrank_jax.nn.merge_adapters` merges
into fp or a re-quantized base. The quantized types register themselves with
:func:`~lowrank_jax.nn.register_projection`, so ``lowrank_jax.nn`` never imports this package.

Example::

    >>> from flax import nnx
    >>> class MLP(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.up = nnx.Linear(64, 128, rngs=rngs)
    >>> errors = quantize_projections(MLP(nnx.Rngs(0)), "up", "nf4")
    >>> list(errors), 0 < errors["up"] < 0.2
    (['up'], True)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowrank_jax.nn.projection import (
    ReadsThrough,
    dense_matrix,
    kernel_axis_names,
    matched_projections,
    projection_bias,
    projection_type,
    projection_view,
    public_attributes,
    register_projection,
    set_child,
)
from lowrank_jax.quant.layers import RTNLinear
from lowrank_jax.quant.nf4 import NF4Linear, nf4_quantize
from lowrank_jax.quant.rtn import rtn_quantize

PROJECTION_QUANTIZERS = ("nf4", "rtn4")


class QuantizedProjection(ReadsThrough, nnx.Module):
    """A frozen quantized base for a projection of any layout: the matrix view's ``[out, in]``
    weight held by a quantized linear (RTN, NF4, UniSVQ), applied as
    ``unflat(quantized(flat(x))) (+ bias)``.

    It keeps the replaced module's interface: its public plain attributes (``.shape``,
    ``.einsum_str``, sizes, dtypes) read through (:class:`~lowrank_jax.nn.ReadsThrough`),
    and its kernel's logical axes are kept (``kernel_axes``) for the adapters put on it.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> q = nnx.Einsum("BTD,DNH->BTNH", (64, 2, 32), rngs=nnx.Rngs(0))
        >>> qp = QuantizedProjection.from_projection(q, "nf4")
        >>> x = jnp.ones((1, 3, 64))
        >>> error = jnp.linalg.norm(qp(x) - q(x)) / jnp.linalg.norm(q(x))
        >>> qp(x).shape, bool(error < 0.15), qp.kernel_shape
        ((1, 3, 2, 32), True, (64, 2, 32))

    Args:
        quantized: a quantized linear (registered with ``register_projection``) holding the
            ``[out, in]`` weight.
        view: the :class:`~lowrank_jax.nn.ProjectionView` of the original projection.
        bias: the original bias over the output's kernel axes, kept in fp.
        replaced_attributes, replaced_type: what the original exposed (see
            ``public_attributes``).
        kernel_axes: the original kernel's logical axis names.
    """

    def __init__(self, quantized: nnx.Module, view, bias=None, *,
                 replaced_attributes: tuple = (), replaced_type: str | None = None,
                 kernel_axes: tuple | None = None):
        self.quantized = quantized
        self.view = view
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)
        self.replaced_attributes, self.replaced_type = tuple(replaced_attributes), replaced_type
        self.kernel_axes = None if kernel_axes is None else tuple(kernel_axes)

    @classmethod
    def from_projection(cls, module, method: str, *, group_size: int = 64,
                        double_quant: bool = False) -> "QuantizedProjection":
        """Quantize a projection module with ``method`` ``"nf4"`` or ``"rtn4"``."""
        view = projection_view(module)
        w = jnp.asarray(dense_matrix(module), jnp.float32).T  # [out, in]
        bias = projection_bias(module)
        bias = None if bias is None else bias[...]
        if bias is not None and tuple(bias.shape) != view.out_shape:
            raise ValueError(f"quantize_projections: a bias of shape {bias.shape} is not over the "
                             f"output's kernel axes {view.out_shape}; it cannot be kept.")
        return cls(quantize_matrix(w, method, group_size=group_size, double_quant=double_quant),
                   view, bias, replaced_attributes=public_attributes(module),
                   replaced_type=type(module).__name__, kernel_axes=kernel_axis_names(module))

    def projection_view(self):
        """The layout of the original projection."""
        return self.view

    def dense_matrix(self):
        """The dequantized matrix view ``[in, out]`` (fp32)."""
        return dense_matrix(self.quantized)

    def requantized(self, matrix) -> "QuantizedProjection":
        """The same kind of base holding ``matrix`` ``[in, out]`` (for merging)."""
        new = projection_type(self.quantized).requantize(self.quantized, matrix)
        return QuantizedProjection(new, self.view, None if self.bias is None else self.bias[...],
                                   replaced_attributes=self.replaced_attributes,
                                   replaced_type=self.replaced_type, kernel_axes=self.kernel_axes)

    def __call__(self, inputs):
        y = self.view.unflatten_output(self.quantized(self.view.flatten_input(inputs)))
        if self.bias is not None:
            y = y + jnp.reshape(self.bias[...], self.view.bias_shape(y.ndim)).astype(y.dtype)
        return y


register_projection(QuantizedProjection, kernel=None, equation=lambda m: m.view.equation,
                    shape=lambda m: m.view.kernel_shape, dense=lambda m: m.dense_matrix(),
                    requantize=lambda m, w: m.requantized(w), bias="bias",
                    method="quantized projection")


def quantize_matrix(weight, method: str, *, group_size: int = 64, double_quant: bool = False):
    """A quantized linear (``y = x Ŵᵀ``) holding ``weight`` ``[out, in]``: ``"nf4"`` (QLoRA's
    NF4, blocks of ``group_size`` inputs) or ``"rtn4"`` (RTN 4-bit, groups of ``group_size``)."""
    if method == "nf4":
        return NF4Linear(nf4_quantize(weight, group_size, double_quant=double_quant))
    if method == "rtn4":
        return RTNLinear(rtn_quantize(weight, 4, group_size))
    raise ValueError(f"quantize_projections: method={method!r} is unknown; use one of "
                     f"{', '.join(PROJECTION_QUANTIZERS)} (UniSVQ needs calibration: "
                     "lowrank_jax.quantize.pipeline).")


def quantize_projections(model: nnx.Module, rules, method: str = "nf4", *,
                         group_size: int = 64, double_quant: bool = False) -> dict[str, float]:
    """Quantize the matched projections of any NNX model (in place) for QLoRA.

    Every projection whose ``/`` path a rule (a regex or a list of regexes) matches becomes a
    :class:`QuantizedProjection`; then ``apply_lora`` adds adapters on top and ``merge_adapters``
    merges them. Works through the projection protocol, not through our ``Llama``.

    Args:
        model: any NNX module.
        rules: a regex ``re.search``-ed in the module paths, or a list of them.
        method: ``"nf4"`` or ``"rtn4"``.
        group_size: inputs per absmax block / scale group (the ``in`` size of every matched
            projection's matrix view must be a multiple of it).
        double_quant: NF4 double quantization.

    Returns:
        ``{path: relative Frobenius error of the quantized weight}``.
    """
    patterns = [rules] if isinstance(rules, str) else list(rules)
    if method not in PROJECTION_QUANTIZERS:
        quantize_matrix(None, method)  # raises the clear error
    matched = matched_projections(model, patterns, "quantize_projections",
                                  skip=(QuantizedProjection,))
    for _, name, module, _ in matched:  # every error before the model changes
        view = projection_view(module, f"quantize_projections({name}): ")
        if view.in_features % group_size:
            raise ValueError(
                f"quantize_projections: {name} has {view.in_features} inputs, not a multiple of "
                f"group_size={group_size}; pass a group_size that divides it.")
    errors = {}
    for path, name, module, _ in matched:
        w = jnp.asarray(dense_matrix(module), jnp.float32)
        new = QuantizedProjection.from_projection(module, method, group_size=group_size,
                                                  double_quant=double_quant)
        errors[name] = float(jnp.linalg.norm(new.dense_matrix() - w)
                             / jnp.maximum(jnp.linalg.norm(w), 1e-30))
        set_child(model, path, new)
    return errors


__all__ = ["PROJECTION_QUANTIZERS", "QuantizedProjection", "quantize_matrix",
           "quantize_projections"]
