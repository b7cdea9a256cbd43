"""QLoRA: a LoRA adapter on a frozen quantized projection, dequantized on the fly.

:class:`QLoRALinear` wraps any *linear-like* base module (``[..., in] → [..., out]`` with
``in_features`` / ``out_features``): RTN 4-bit with per-group scales (``RTNLinear``), NF4 as QLoRA
defines it (``NF4Linear``) and UniSVQ 2-bit (``QuantizedLinear``, whose forward runs through the
``lattice_matmul`` kernel API, never forming ``W``). The base keeps its codes and scales; only
``lora_a`` / ``lora_b`` (``nnx.LoRAParam``) train with ``wrt=nnx.LoRAParam``.

Each built-in quantized type is registered with :func:`lowrank_jax.nn.inject.register_linear_like`
together with how to read its dense weight and how to re-quantize a dense weight the same way, so
:func:`~lowrank_jax.nn.apply_lora` wraps it and :mod:`lowrank_jax.nn.merge` can merge into it.

.. math:: y = \\mathrm{base}(x) + s\\,(x A) B,\\qquad s = \\alpha / r

References:
    Dettmers et al, `QLoRA <https://arxiv.org/abs/2305.14314>`_, 2023; Hu et al,
    `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from lowrank_jax.nn.factorized import check_rank
from lowrank_jax.nn.inject import LinearLike, register_linear_like
from lowrank_jax.nn.lora import default_a_initializer, default_b_initializer, lora_scaling


class QLoRALinear(nnx.Module):
    """A frozen quantized ``base`` plus a LoRA adapter: ``y = base(x) + s · dropout(x) A B``.

    Same adapter names, layout and scale as :class:`~lowrank_jax.nn.LoRALinear` (``lora_a``
    ``[in, r]``, ``lora_b`` ``[r, out]``, ``s = alpha / r``), so PEFT export / import and
    :func:`~lowrank_jax.nn.lora_layers` treat both alike. The adapter cannot be folded into
    integer codes in place: merge with :func:`lowrank_jax.nn.merge.merge_adapters` (into fp, exact,
    or into a re-quantized base, with its error reported).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from lowrank_jax.quant.nf4 import NF4Linear, nf4_quantize
        >>> base = NF4Linear(nf4_quantize(jax.random.normal(jax.random.PRNGKey(0), (8, 64))))
        >>> layer = QLoRALinear(base, rank=4, rngs=nnx.Rngs(0))
        >>> bool(jnp.allclose(layer(jnp.ones((2, 64))), base(jnp.ones((2, 64)))))
        True

    Args:
        base: a registered linear-like module (kept frozen: its arrays are not ``LoRAParam``).
        rank, alpha, use_rslora, dropout: as :class:`~lowrank_jax.nn.LoRALinear`.
        init: ``"standard"`` (A he-uniform, B zero) or ``"gaussian"``; PiSSA / OLoRA rewrite the
            base weight and are refused on a quantized base.
        param_dtype: dtype of the adapter factors (fp32 default).
    """

    def __init__(
        self,
        base: nnx.Module,
        *,
        rank: int,
        alpha: float | None = None,
        use_rslora: bool = False,
        dropout: float = 0.0,
        init: str = "standard",
        param_dtype: Any = jnp.float32,
        a_initializer=default_a_initializer,
        b_initializer=default_b_initializer,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        check_rank(rank, self.in_features, self.out_features, "QLoRALinear: ")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"QLoRALinear: dropout={dropout} must lie in [0, 1).")
        self.base = base
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.param_dtype = param_dtype
        self.merged = False
        if init == "standard":
            a = a_initializer(rngs.params(), (self.in_features, rank), param_dtype)
        elif init == "gaussian":
            a = jax.random.normal(rngs.params(), (self.in_features, rank), param_dtype) / rank
        else:
            raise ValueError(
                f"QLoRALinear: init={init!r} is not available on a quantized base (PiSSA / "
                "OLoRA rewrite the base weight); use 'standard' or 'gaussian', or merge into fp "
                "first."
            )
        self.lora_a = nnx.LoRAParam(a)
        self.lora_b = nnx.LoRAParam(
            b_initializer(rngs.params(), (rank, self.out_features), param_dtype))
        self.lora_dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else nnx.data(None)

    def delta(self) -> Float[Array, "in out"]:
        """The adapter's dense update ``s · A B``."""
        return self.scaling * (self.lora_a[...] @ self.lora_b[...])

    def base_weight(self) -> Float[Array, "out in"]:
        """The base's dequantized fp32 weight ``[out, in]`` (``y = x Wᵀ``)."""
        return linear_like_of(self.base).dense(self.base)

    def merge(self) -> None:
        raise ValueError(
            "QLoRALinear.merge: an adapter cannot be folded into integer codes in place; use "
            "lowrank_jax.nn.merge.merge_adapters(model, target='fp' | 'quantized')."
        )

    def unmerge(self) -> None:
        raise ValueError("QLoRALinear.unmerge: a QLoRA adapter is never merged in place.")

    def __call__(self, inputs: Float[ArrayLike, "... in"], *, deterministic: bool | None = None):
        out = self.base(inputs)
        x = jnp.asarray(inputs)
        if self.lora_dropout is not None:
            x = self.lora_dropout(x, deterministic=deterministic)
        a, b = self.lora_a[...], self.lora_b[...]
        h = (x.astype(a.dtype) @ a) @ b
        return (out + self.scaling * h.astype(out.dtype)).astype(out.dtype)


def linear_like_of(module: nnx.Module) -> LinearLike:
    """The registry entry of ``module``'s type (clear error for an unregistered type)."""
    from lowrank_jax.nn.inject import LINEAR_LIKE

    entry = LINEAR_LIKE.get(type(module))
    if entry is None:
        raise ValueError(
            f"{type(module).__name__} is not a registered linear-like module; register it with "
            "lowrank_jax.nn.inject.register_linear_like(cls, ...)."
        )
    return entry


def _wrap(base, **kwargs) -> QLoRALinear:
    return QLoRALinear(base, **kwargs)


def _register_builtins() -> None:
    from lowrank_jax.quant.layers import QuantizedLinear, RTNLinear
    from lowrank_jax.quant.nf4 import NF4Linear, nf4_dequantize, nf4_quantize
    from lowrank_jax.quant.rtn import rtn_dequantize, rtn_quantize
    from lowrank_jax.quant.unisvq import UniSVQConfig, dequantize, quantize_linear

    def rtn_requant(layer, w):
        return RTNLinear(rtn_quantize(w, layer.bits, layer.group_size))

    def nf4_requant(layer, w):
        return NF4Linear(nf4_quantize(w, layer.block_size, double_quant=layer.double_quant))

    def unisvq_requant(layer, w):
        cfg = UniSVQConfig(hadamard_block=max(layer.block_in, layer.block_out))
        q = quantize_linear(w, None, cfg)
        return QuantizedLinear(q, mode=layer.mode, implementation=layer.implementation)

    register_linear_like(RTNLinear, LinearLike(
        wrap=_wrap, dense=lambda m: rtn_dequantize(m.weight()), requantize=rtn_requant,
        method="rtn"), QLoRALinear)
    register_linear_like(NF4Linear, LinearLike(
        wrap=_wrap, dense=lambda m: nf4_dequantize(m.weight()), requantize=nf4_requant,
        method="nf4"), QLoRALinear)
    register_linear_like(QuantizedLinear, LinearLike(
        wrap=_wrap, dense=lambda m: dequantize(m.weight()), requantize=unisvq_requant,
        method="unisvq"), QLoRALinear)


_register_builtins()


class QuantizedProjection(nnx.Module):
    """A frozen quantized base for a projection of any layout (``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum``, a user einsum module): the matrix view's ``[out, in]``
    weight held by a quantized linear (RTN, NF4, UniSVQ), applied as
    ``unflat(quantized(flat(x))) (+ bias)``.

    It declares its layout with ``projection_view()``, so :func:`~lowrank_jax.nn.apply_lora`
    puts a :class:`~lowrank_jax.nn.LoRAProjection` on it (QLoRA) and
    :func:`lowrank_jax.nn.merge.merge_adapters` merges into fp or a re-quantized base.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> q = nnx.Einsum("BTD,DNH->BTNH", (64, 2, 32), rngs=nnx.Rngs(0))
        >>> qp = QuantizedProjection.from_projection(q, "nf4")
        >>> x = jnp.ones((1, 3, 64))
        >>> error = jnp.linalg.norm(qp(x) - q(x)) / jnp.linalg.norm(q(x))
        >>> qp(x).shape, bool(error < 0.15)
        ((1, 3, 2, 32), True)

    Args:
        quantized: a registered quantized linear holding the ``[out, in]`` weight.
        view: the :class:`~lowrank_jax.nn.projection.ProjectionView` of the original projection.
        bias: the original bias over the output's kernel axes, kept in fp.
    """

    def __init__(self, quantized: nnx.Module, view, bias=None):
        self.quantized = quantized
        self.view = view
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)

    @classmethod
    def from_projection(cls, module, method: str, *, group_size: int = 64,
                        double_quant: bool = False) -> "QuantizedProjection":
        """Quantize a projection module with ``method`` ``"nf4"`` or ``"rtn4"``."""
        from lowrank_jax.nn.projection import kernel_as_matrix, projection_bias, projection_view

        view = projection_view(module)
        w = jnp.asarray(kernel_as_matrix(module), jnp.float32).T  # [out, in]
        bias = projection_bias(module)
        bias = None if bias is None else bias[...]
        if bias is not None and tuple(bias.shape) != view.out_shape:
            raise ValueError(f"quantize_projections: a bias of shape {bias.shape} is not over the "
                             f"output's kernel axes {view.out_shape}; it cannot be kept.")
        return cls(quantize_matrix(w, method, group_size=group_size,
                                   double_quant=double_quant), view, bias)

    def projection_view(self):
        """The layout of the original projection."""
        return self.view

    def dense_matrix(self):
        """The dequantized matrix view ``[in, out]`` (fp32)."""
        return linear_like_of(self.quantized).dense(self.quantized).T

    def requantized(self, weight) -> "QuantizedProjection":
        """The same kind of base holding ``weight`` ``[out, in]`` (for merging)."""
        new = linear_like_of(self.quantized).requantize(self.quantized, weight)
        return QuantizedProjection(new, self.view,
                                   None if self.bias is None else self.bias[...])

    def __call__(self, inputs):
        y = self.view.unflatten_output(self.quantized(self.view.flatten_input(inputs)))
        if self.bias is not None:
            y = y + jnp.reshape(self.bias[...], self.view.bias_shape(y.ndim)).astype(y.dtype)
        return y


PROJECTION_QUANTIZERS = ("nf4", "rtn4")


def quantize_matrix(weight, method: str, *, group_size: int = 64, double_quant: bool = False):
    """A quantized linear (``y = x Ŵᵀ``) holding ``weight`` ``[out, in]``: ``"nf4"`` (QLoRA's
    NF4, blocks of ``group_size`` inputs) or ``"rtn4"`` (RTN 4-bit, groups of ``group_size``)."""
    from lowrank_jax.quant.layers import RTNLinear
    from lowrank_jax.quant.nf4 import NF4Linear, nf4_quantize
    from lowrank_jax.quant.rtn import rtn_quantize

    if method == "nf4":
        return NF4Linear(nf4_quantize(weight, group_size, double_quant=double_quant))
    if method == "rtn4":
        return RTNLinear(rtn_quantize(weight, 4, group_size))
    raise ValueError(f"quantize_projections: method={method!r} is unknown; use one of "
                     f"{', '.join(PROJECTION_QUANTIZERS)} (UniSVQ needs calibration: "
                     "lowrank_jax.quant.pipeline).")


def quantize_projections(model: nnx.Module, rules, method: str = "nf4", *,
                         group_size: int = 64, double_quant: bool = False) -> dict[str, float]:
    """Quantize the matched projections of any NNX model (in place) for QLoRA.

    Every projection whose ``/`` path a rule (a regex or a list of regexes) matches becomes a
    :class:`QuantizedProjection`; then ``apply_lora`` adds adapters on top and ``merge_adapters``
    merges them. Works through the projection protocol, not through our ``Llama``.

    Example::

        >>> from flax import nnx
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.up = nnx.Linear(64, 128, rngs=rngs)
        >>> errors = quantize_projections(MLP(nnx.Rngs(0)), "up", "nf4")
        >>> list(errors), 0 < errors["up"] < 0.2
        (['up'], True)

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
    from lowrank_jax.nn.projection import (
        kernel_as_matrix, matched_projections, projection_view, set_child)

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
        w = jnp.asarray(kernel_as_matrix(module), jnp.float32)
        new = QuantizedProjection.from_projection(module, method, group_size=group_size,
                                                  double_quant=double_quant)
        errors[name] = float(jnp.linalg.norm(new.dense_matrix() - w)
                             / jnp.maximum(jnp.linalg.norm(w), 1e-30))
        set_child(model, path, new)
    return errors

def _nbytes(tree) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def memory_bytes(model: nnx.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes the training state holds: ``trainable`` (``LoRAParam``), ``frozen`` (everything
    else of the model: codes, scales, dense weights), ``optimizer`` (the state of an
    ``nnx.Optimizer``, or an optax state: ``tx.init(...)``) and ``total``.

    Example::

        >>> from lowrank_jax.models.presets import preset_model
        >>> memory_bytes(preset_model("tiny"))["trainable"]
        0
    """
    trainable = _nbytes(nnx.state(model, nnx.LoRAParam))
    frozen = _nbytes(nnx.state(model, nnx.Not(nnx.LoRAParam)))
    if isinstance(optimizer, nnx.Optimizer):
        optimizer = nnx.state(optimizer, nnx.OptState)
    opt = 0 if optimizer is None else _nbytes(optimizer)
    return {"trainable": trainable, "frozen": frozen, "optimizer": opt,
            "total": trainable + frozen + opt}


__all__ = ["PROJECTION_QUANTIZERS", "QLoRALinear", "QuantizedProjection", "linear_like_of",
           "memory_bytes", "quantize_matrix", "quantize_projections"]
