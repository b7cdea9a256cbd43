"""LoRA: the one adapter body (:class:`LoRA`) and the layers that carry it.

:class:`LoRA` is the adapter, written once, as flax writes ``nnx.LoRA``: ``lora_a`` ``[in, r]`` and
``lora_b`` ``[r, out]`` as ``nnx.LoRAParam``, the scale ``s`` (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA), input dropout, the initialisations (standard, gaussian, PiSSA)
and the merge / unmerge / PiSSA split over the base's matrix view. Used alone it maps
``[..., in] -> [..., out]``; every adapted layer is a :class:`LoRA` over a base:

- :class:`LoRALinear` — an ``nnx.Linear`` (the state keeps ``kernel`` / ``bias``);
- :class:`LoRAProjection` — any other projection (``nnx.LinearGeneral``, ``nnx.Einsum``, a user's
  einsum module), the adapter over the matrix view of :mod:`lowrank_jax.nn.projection`;
- :class:`QLoRALinear` — a frozen base without a dense kernel (a quantized one, registered with
  :func:`~lowrank_jax.nn.register_projection`), dequantized on the fly, merged with
  :func:`lowrank_jax.nn.merge_adapters`.

The factors sit on the adapted layer itself (``.../q_proj/lora_a``), not in a ``lora/``
sub-module as in flax: that is the layout PEFT export, the pair finder
(:mod:`lowrank_jax.optim.factors`), the per-layer optimizers and saved checkpoints read, so the
adapted layers inherit the body instead of holding it. They carry logical axis metadata
(``out_sharding``) taken from the base kernel's: ``A`` the contracted axes' name, ``B`` the free
axes', the rank axis unsharded (``factor_axis_names``).

.. math:: y = \\mathrm{base}(x) + s\\,\\mathrm{dropout}(x) A B

References:
    Hu et al, `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021; Kalajdzievski,
    `rsLoRA <https://arxiv.org/abs/2312.03732>`_, 2023; Meng et al,
    `PiSSA <https://arxiv.org/abs/2404.02948>`_, 2024; Dettmers et al,
    `QLoRA <https://arxiv.org/abs/2305.14314>`_, 2023.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from lowrank_jax.nn.factorized import check_rank
from lowrank_jax.nn.projection import (
    NOT_PROJECTIONS,
    ReadsThrough,
    assign_keeping_layout,
    dense_matrix,
    factor_axis_names,
    kernel_axis_names,
    new_param,
    projection_kernel,
    projection_type,
    projection_view,
)

default_a_initializer = nnx.initializers.he_uniform()
default_b_initializer = nnx.initializers.zeros_init()

LoRAInit = Literal["standard", "pissa", "gaussian"]
LORA_INITS = ("standard", "gaussian", "pissa")


def lora_scaling(rank: int, alpha: float | None, use_rslora: bool) -> float:
    """PEFT's scale: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA (alpha defaults to
    rank)."""
    alpha = float(rank if alpha is None else alpha)
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def lora_output(x, a, b, scale, *, dtype: Any = None, apply=None):
    """The one adapter body, ``scale · (x A) B`` (never forming ``A B``), for every adapter of
    the package (LoRA, QLoRA, LoRA over any projection, LoKRA's equivalent factors).

    Args:
        x: inputs ``[..., in]``.
        a, b: the factors ``[in, r]``, ``[r, out]``.
        scale: the adapter's scale ``s``.
        dtype: compute dtype (``None``: the promoted dtype of ``x``, ``a``, ``b``).
        apply: ``apply(x, a, b)`` instead of ``(x @ a) @ b`` (a layout passes its own, e.g.
            :meth:`~lowrank_jax.nn.ProjectionView.apply_factors`).

    Example::

        >>> import jax.numpy as jnp
        >>> lora_output(jnp.ones((1, 3)), jnp.ones((3, 2)), jnp.ones((2, 4)), 0.5)
        Array([[3., 3., 3., 3.]], dtype=float32)
    """
    x, a, b = nnx.nn.dtypes.promote_dtype((x, a, b), dtype=dtype)
    h = (x @ a) @ b if apply is None else apply(x, a, b)
    return scale * h


class LoRA(nnx.Module):
    """The adapter body: ``s · dropout(x) A B`` with ``A [in, r]``, ``B [r, out]``
    (``nnx.LoRAParam``), written once and inherited by every adapted layer.

    Used alone (as ``nnx.LoRA``) it maps ``[..., in] -> [..., out]``. A layer that carries it
    calls :meth:`init_adapter` in its constructor, adds :meth:`adapter_update` to its base's
    output and defines two hooks over its base: :meth:`dense_matrix` (the base's weight
    ``[in, out]``) and :meth:`add_to_base` (fold a matrix into it), which :meth:`merge`,
    :meth:`unmerge` and :meth:`init_pissa` use.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> lora = LoRA(16, 4, 8, alpha=8.0, rngs=nnx.Rngs(0))
        >>> lora.lora_a.shape, lora.scaling, float(jnp.abs(lora(jnp.ones((2, 16)))).max())
        ((16, 4), 2.0, 0.0)

    Args:
        in_features, rank, out_features: ``A [in, rank]``, ``B [rank, out]``.
        alpha: scale numerator (PEFT's ``lora_alpha``); defaults to ``rank`` (scale 1).
        use_rslora: scale by ``alpha / sqrt(rank)`` (rank-stabilised LoRA).
        dropout: dropout rate on the adapter's input (needs ``rngs`` with a ``dropout`` stream
            at call time unless ``deterministic``).
        init: ``"standard"`` (A he-uniform, B zero) or ``"gaussian"`` (A normal(1/r), B zero);
            a layer with a base also takes ``"pissa"`` (A, B from the base's top-r SVD).
        dtype: compute dtype (``None``: promote the input and the factors).
        param_dtype: dtype of the factors.
        a_axes, b_axes: logical axis names of ``A`` / ``B`` (``out_sharding`` metadata).
        rngs: keys for the initialisation (and dropout).
    """

    def __init__(self, in_features: int, rank: int, out_features: int, *,
                 alpha: float | None = None, use_rslora: bool = False, dropout: float = 0.0,
                 init: str = "standard", dtype: Any = None, param_dtype: Any = jnp.float32,
                 a_initializer=default_a_initializer, b_initializer=default_b_initializer,
                 a_axes: tuple | None = None, b_axes: tuple | None = None, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.param_dtype = dtype, param_dtype
        self.init_adapter(in_features, out_features, rank=rank, alpha=alpha,
                          use_rslora=use_rslora, dropout=dropout, init=init,
                          param_dtype=param_dtype, a_initializer=a_initializer,
                          b_initializer=b_initializer, a_axes=a_axes, b_axes=b_axes, rngs=rngs,
                          inits=("standard", "gaussian"))

    # ------------------------------------------------------------------ the body
    def init_adapter(self, in_features: int, out_features: int, *, rank: int,
                     alpha: float | None, use_rslora: bool, dropout: float, init: str,
                     param_dtype: Any, a_initializer, b_initializer, rngs: nnx.Rngs,
                     a_axes: tuple | None = None, b_axes: tuple | None = None, like=None,
                     inits: tuple[str, ...] = LORA_INITS) -> None:
        """Check the options and create ``lora_a``, ``lora_b``, the scale and the dropout
        (``init="pissa"`` leaves the split to :meth:`init_pissa`, called by the layer once its
        base is in place). ``like``: the base kernel variable whose mesh metadata the factors
        share."""
        where = f"{type(self).__name__}: "
        check_rank(rank, in_features, out_features, where)
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"{where}dropout={dropout} must lie in [0, 1).")
        if init not in inits:
            raise ValueError(f"{where}unknown init={init!r}; use one of {', '.join(inits)} "
                             "(more in lowrank_jax.nn.init).")
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.merged = False
        if init == "gaussian":
            a = jax.random.normal(rngs.params(), (in_features, rank), param_dtype) / rank
        else:
            a = a_initializer(rngs.params(), (in_features, rank), param_dtype)
        b = b_initializer(rngs.params(), (rank, out_features), param_dtype)
        self.lora_a = new_param(nnx.LoRAParam, a, a_axes, like)
        self.lora_b = new_param(nnx.LoRAParam, b, b_axes, like)
        self.lora_dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else nnx.data(None)

    def delta(self) -> Float[Array, "in out"]:
        """The adapter's dense update ``s · A B`` (over the base's matrix view ``[in, out]``)."""
        return self.scaling * (self.lora_a[...] @ self.lora_b[...])

    def adapter_update(self, x, *, apply=None, dtype: Any = None,
                       deterministic: bool | None = None):
        """``s · apply(dropout(x), A, B)``; ``apply`` defaults to ``(x @ A) @ B`` (a layout
        passes its own, e.g. :meth:`ProjectionView.apply_factors`). ``dtype``: compute dtype
        (``None``: promoted)."""
        if self.lora_dropout is not None:
            x = self.lora_dropout(x, deterministic=deterministic)
        return lora_output(x, self.lora_a[...], self.lora_b[...], self.scaling, dtype=dtype,
                           apply=apply)

    def __call__(self, inputs: Float[ArrayLike, "... in"], *, deterministic: bool | None = None):
        return self.adapter_update(jnp.asarray(inputs), dtype=self.dtype,
                                   deterministic=deterministic)

    # ------------------------------------------------------------------ over a base
    def dense_matrix(self) -> Float[Array, "in out"]:
        """The base's weight as the matrix ``[in, out]`` (fp32), without the adapter."""
        raise ValueError(f"{type(self).__name__} has no base weight (a standalone adapter).")

    def add_to_base(self, matrix) -> None:
        """Fold ``matrix`` ``[in, out]`` into the base weight (in its layout, dtype, sharding)."""
        raise ValueError(f"{type(self).__name__} has no base to merge into (a standalone "
                         "adapter).")

    def merge(self) -> None:
        """Fold the adapter into the base (``W += s A B``); the adapter then adds nothing."""
        if self.merged:
            raise ValueError(f"{type(self).__name__}.merge: the adapter is already merged; "
                             "unmerge first.")
        self.add_to_base(self.delta().astype(jnp.float32))
        self.merged = True

    def unmerge(self) -> None:
        """Undo :meth:`merge` (``W -= s A B``)."""
        if not self.merged:
            raise ValueError(f"{type(self).__name__}.unmerge: the adapter is not merged.")
        self.add_to_base(-self.delta().astype(jnp.float32))
        self.merged = False

    def init_pissa(self) -> None:
        """PiSSA: A, B take the base's top-``rank`` singular triplets, the base keeps the residual
        (the layer's output is unchanged)."""
        w = jnp.asarray(self.dense_matrix(), jnp.float32)
        u, s, vt = jnp.linalg.svd(w, full_matrices=False)
        root = jnp.sqrt(s[:self.rank] / self.scaling)
        a, b = u[:, :self.rank] * root[None, :], root[:, None] * vt[:self.rank]
        assign_keeping_layout(self.lora_a, a)
        assign_keeping_layout(self.lora_b, b)
        self.add_to_base(-self.scaling * (a @ b))


class LoRALinear(LoRA, nnx.Linear):
    """``nnx.Linear`` plus the :class:`LoRA` adapter: ``y = x W + b + s · dropout(x) A B``.

    The state keeps ``nnx.Linear``'s names (``kernel``, ``bias``) and adds ``lora_a`` ``[in, rank]``
    and ``lora_b`` ``[rank, out]`` as ``nnx.LoRAParam``, so ``nnx.Optimizer(model, tx,
    wrt=nnx.LoRAParam)`` trains only the adapter and a checkpoint of the base still loads.

    .. math:: s = \\alpha / r \\quad (\\text{rsLoRA: } s = \\alpha / \\sqrt{r})

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> layer = LoRALinear(16, 8, rank=4, alpha=8.0, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 16))).shape
        (2, 8)

    Args:
        in_features, out_features: sizes, as ``nnx.Linear``.
        rank, alpha, use_rslora, dropout: as :class:`LoRA`.
        init: ``"standard"``, ``"gaussian"`` or ``"pissa"`` (A, B from the top-r SVD of the
            kernel; the kernel keeps the residual, so the layer's output is unchanged).
        kwargs: everything else ``nnx.Linear`` takes (``use_bias``, ``dtype``, ``param_dtype``,
            ``kernel_init``, ``kernel_metadata``, ``rngs``, ...).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float | None = None,
        use_rslora: bool = False,
        dropout: float = 0.0,
        init: LoRAInit = "standard",
        a_initializer=default_a_initializer,
        b_initializer=default_b_initializer,
        rngs: nnx.Rngs,
        **linear_kwargs: Any,
    ):
        nnx.Linear.__init__(self, in_features, out_features, rngs=rngs, **linear_kwargs)
        a_axes, b_axes = self._factor_axes()
        self.init_adapter(in_features, out_features, rank=rank, alpha=alpha,
                          use_rslora=use_rslora, dropout=dropout, init=init,
                          param_dtype=self.param_dtype, a_initializer=a_initializer,
                          b_initializer=b_initializer, a_axes=a_axes, b_axes=b_axes,
                          like=self.kernel, rngs=rngs)
        if init == "pissa":
            self.init_pissa()

    def _factor_axes(self) -> tuple[tuple | None, tuple | None]:
        names = self.kernel.get_metadata().get("out_sharding")
        return ((names[0], None), (None, names[1])) if names else (None, None)

    @classmethod
    def from_linear(
        cls, linear: nnx.Linear, *, rank: int, rngs: nnx.Rngs, **kwargs
    ) -> "LoRALinear":
        """Wrap an existing ``nnx.Linear`` (its kernel and bias are shared, not copied; the
        factors take the kernel's logical axes)."""
        pissa = kwargs.get("init") == "pissa"
        if pissa:
            kwargs = {**kwargs, "init": "standard"}
        layer = cls(linear.in_features, linear.out_features, rank=rank,
                    use_bias=linear.bias is not None, dtype=linear.dtype,
                    param_dtype=linear.param_dtype, precision=linear.precision, rngs=rngs,
                    **kwargs)
        layer.kernel = linear.kernel
        layer.bias = linear.bias
        a_axes, b_axes = layer._factor_axes()
        if a_axes is not None:  # the factors carry the shared kernel's axes
            layer.lora_a = new_param(nnx.LoRAParam, layer.lora_a[...], a_axes, layer.kernel)
            layer.lora_b = new_param(nnx.LoRAParam, layer.lora_b[...], b_axes, layer.kernel)
        if pissa:
            layer.init_pissa()
        return layer

    def dense_matrix(self) -> Float[Array, "in out"]:
        """The kernel ``[in, out]`` (fp32; without the adapter unless merged)."""
        return self.kernel[...].astype(jnp.float32)

    def add_to_base(self, matrix) -> None:
        assign_keeping_layout(self.kernel, self.kernel[...].astype(jnp.float32) + matrix)

    def __call__(self, inputs: Float[ArrayLike, "... in"], *, deterministic: bool | None = None):
        out = nnx.Linear.__call__(self, inputs)
        if self.merged:
            return out
        return out + self.adapter_update(inputs, dtype=self.dtype, deterministic=deterministic)


class LoRAProjection(ReadsThrough, LoRA):
    """Any projection (``nnx.LinearGeneral``, ``nnx.Einsum``, a user einsum module) plus the
    :class:`LoRA` adapter over its matrix view: ``y = base(x) + s · unflat(flat(x) A B)``.

    The base module is kept as it is (``base``) and called with the same arguments, so the
    wrapper keeps its call signature, and every public attribute it does not define reads
    through to the base (``.shape``, ``.einsum_str``, ``.kernel_shape``, ``.dtype``,
    ``in_features``...; the matrix view's sizes are ``view.in_features`` / ``view.out_features``).
    ``lora_a`` ``[in, rank]`` and
    ``lora_b`` ``[rank, out]`` are matrices over the grouped axes of
    :func:`lowrank_jax.nn.projection_view` (for an attention kernel ``[D, N, H]``: ``A [D, r]``,
    ``B [r, N·H]``), the layout PEFT stores.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> q = nnx.Einsum("BTD,DNH->BTNH", (8, 2, 4), rngs=nnx.Rngs(0))
        >>> layer = LoRAProjection(q, rank=2, rngs=nnx.Rngs(1))
        >>> x = jnp.ones((1, 3, 8))
        >>> layer.lora_b[...].shape, bool(jnp.allclose(layer(x), q(x))), layer.einsum_str
        ((2, 8), True, 'BTD,DNH->BTNH')

    Args:
        base: a projection module (see :mod:`lowrank_jax.nn.projection`).
        rank, alpha, use_rslora, dropout, init: as :class:`LoRALinear` (``init="pissa"`` splits
            the top-``rank`` SVD of the matrix view off the base kernel).
        param_dtype: dtype of the adapter factors (default: the kernel's; fp32 for a base
            without a floating kernel).
    """

    inits: tuple[str, ...] = LORA_INITS

    def __init__(
        self,
        base: nnx.Module,
        *,
        rank: int,
        alpha: float | None = None,
        use_rslora: bool = False,
        dropout: float = 0.0,
        init: LoRAInit = "standard",
        param_dtype: Any = None,
        a_initializer=default_a_initializer,
        b_initializer=default_b_initializer,
        rngs: nnx.Rngs,
    ):
        self.base = base
        self.view = projection_view(base, f"{type(self).__name__}({type(base).__name__}): ")
        kernel = projection_kernel(base)
        kdt = jnp.float32 if kernel is None else kernel[...].dtype
        pdt = param_dtype or (kdt if jnp.issubdtype(kdt, jnp.floating) else jnp.float32)
        self.param_dtype = pdt
        a_axes, b_axes = factor_axis_names(kernel_axis_names(base), self.view)
        self.init_adapter(self.view.in_features, self.view.out_features, rank=rank, alpha=alpha,
                          use_rslora=use_rslora, dropout=dropout, init=init, param_dtype=pdt,
                          a_initializer=a_initializer, b_initializer=b_initializer, rngs=rngs,
                          a_axes=a_axes, b_axes=b_axes, like=kernel, inits=self.inits)
        if init == "pissa":
            self.init_pissa()

    @property
    def in_features(self):
        """The base's ``in_features`` (a tuple for ``nnx.LinearGeneral``), else the matrix view's
        rows."""
        return getattr(self.base, "in_features", self.view.in_features)

    @property
    def out_features(self):
        """The base's ``out_features``, else the matrix view's columns."""
        return getattr(self.base, "out_features", self.view.out_features)

    @property
    def kernel(self):
        """The base's kernel ``nnx.Param`` (in the base's own layout; ``None`` for a base without
        a dense kernel)."""
        return projection_kernel(self.base)

    def dense_matrix(self) -> Float[Array, "in out"]:
        """The base's weight as the matrix view ``[in, out]`` (fp32; a quantized base is
        dequantized)."""
        return jnp.asarray(dense_matrix(self.base), jnp.float32)

    def add_to_base(self, matrix) -> None:
        if projection_type(self.base).frozen:
            raise ValueError(
                f"{type(self).__name__}: an adapter cannot be folded into a "
                f"{type(self.base).__name__} base in place; use "
                "lowrank_jax.nn.merge.merge_adapters(model, target='fp' | 'quantized').")
        kernel = self.kernel
        w = self.view.to_matrix(kernel[...]).astype(jnp.float32) + matrix
        assign_keeping_layout(kernel, self.view.to_kernel(w))

    def __call__(self, *args, deterministic: bool | None = None, **kwargs):
        out = self.base(*args, **kwargs)
        if self.merged:
            return out
        if kwargs.get("einsum_str") not in (None, self.view.equation):
            raise ValueError(
                f"{type(self).__name__}: called with einsum_str={kwargs['einsum_str']!r} but "
                f"the adapter was built for {self.view.equation!r}.")
        kind = projection_type(self.base)
        x = jnp.asarray(args[kind.input_arg] if len(args) > kind.input_arg
                        else kwargs.get("inputs", kwargs.get("x")))
        h = self.adapter_update(x, apply=self.view.apply_factors, dtype=self.param_dtype,
                                deterministic=deterministic)
        return (out + h.astype(out.dtype)).astype(out.dtype)


class QLoRALinear(LoRAProjection):
    """A frozen base without a dense kernel (a quantized linear: RTN, NF4, UniSVQ, or a
    :class:`~lowrank_jax.quant.QuantizedProjection` of any layout) plus the :class:`LoRA`
    adapter: ``y = base(x) + s · dropout(x) A B``, the base dequantized on the fly.

    Same adapter names, layout and scale as :class:`LoRALinear` (``lora_a`` ``[in, r]``,
    ``lora_b`` ``[r, out]``), so PEFT export / import and :func:`~lowrank_jax.nn.lora_layers`
    treat both alike. The adapter cannot be folded into integer codes in place: merge with
    :func:`lowrank_jax.nn.merge_adapters` (into fp, exact, or into a re-quantized base).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from lowrank_jax.quant.nf4 import NF4Linear, nf4_quantize
        >>> base = NF4Linear(nf4_quantize(jax.random.normal(jax.random.PRNGKey(0), (8, 64))))
        >>> layer = QLoRALinear(base, rank=4, rngs=nnx.Rngs(0))
        >>> bool(jnp.allclose(layer(jnp.ones((2, 64))), base(jnp.ones((2, 64)))))
        True

    Args:
        base: a projection registered without a kernel (kept frozen: its arrays are not
            ``LoRAParam``).
        rank, alpha, use_rslora, dropout: as :class:`LoRALinear`.
        init: ``"standard"`` or ``"gaussian"``; PiSSA / OLoRA rewrite the base weight and are
            refused on a quantized base.
        param_dtype: dtype of the adapter factors (fp32 default).
    """

    inits = ("standard", "gaussian")

    def __init__(self, base: nnx.Module, *, rank: int, init: str = "standard",
                 param_dtype: Any = jnp.float32, **kwargs):
        if init not in self.inits:
            raise ValueError(
                f"QLoRALinear: init={init!r} is not available on a quantized base (PiSSA / "
                "OLoRA rewrite the base weight); use 'standard' or 'gaussian', or merge into fp "
                "first.")
        super().__init__(base, rank=rank, init=init, param_dtype=param_dtype, **kwargs)

    def merge(self) -> None:
        """Refused: see :func:`lowrank_jax.nn.merge_adapters`."""
        self.add_to_base(None)

    def unmerge(self) -> None:
        """Refused: a QLoRA adapter is never merged in place."""
        raise ValueError("QLoRALinear.unmerge: a QLoRA adapter is never merged in place.")


def lora_layers(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """``(path, layer)`` for every adapted layer (:class:`LoRALinear`, :class:`LoRAProjection`,
    :class:`QLoRALinear`) in ``model``, paths written with ``/``."""
    return [("/".join(str(p) for p in path), m) for path, m in nnx.iter_modules(model)
            if isinstance(m, (LoRALinear, LoRAProjection))]


# adapted layers are not projections themselves (their base is): never adapted twice
NOT_PROJECTIONS.extend([LoRA, LoRALinear, LoRAProjection, QLoRALinear])

__all__ = ["LORA_INITS", "LoRA", "LoRALinear", "LoRAProjection", "QLoRALinear", "lora_layers",
           "lora_output", "lora_scaling"]
