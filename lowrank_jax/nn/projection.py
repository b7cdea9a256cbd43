"""The projection protocol: how the library sees any model's linear maps, not only our Llama's.

A *projection* is a module that maps the last axes of its input through one kernel: ``nnx.Linear``
(``'...i,io->...o'``), ``nnx.LinearGeneral`` (trailing ``axis``, no ``batch_axis``), ``nnx.Einsum``
with a constructor ``einsum_str`` (``'BTD,DNH->BTNH'``), and the einsum modules of tunix, gemma
and MaxText (a kernel ``nnx.Param`` plus an einsum string), found by duck typing; anything else is
declared with :func:`register_projection`. Every method that adapts, factorizes or quantizes a
projection reads it through :func:`projection_view`: the kernel as a matrix ``[in, out]`` whose
rows are the contracted axes (in the order they appear in the input) and whose columns are the
free axes (in the order they appear in the output), flattened row-major. That is also PEFT's
layout: the transpose of the matrix view is the ``[out, in]`` weight of the equivalent
``torch.nn.Linear`` (``q: [D, N, H] -> weight [N*H, D]``).

.. math:: y = \\mathrm{einsum}(x, K) = \\mathrm{unflat}(\\mathrm{flat}(x)\\,M),\\qquad
          M = \\mathrm{matrix}(K) \\in \\mathbb{R}^{\\text{in} \\times \\text{out}}

Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> q = nnx.Einsum("BTD,DNH->BTNH", (8, 2, 4), rngs=nnx.Rngs(0))
    >>> view = projection_view(q)
    >>> view.in_shape, view.out_shape, view.to_matrix(q.kernel[...]).shape
    ((8,), (2, 4), (8, 8))
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from lowrank_jax.nn.projection_view import ProjectionView
from lowrank_jax.nn.swap import (  # noqa: F401  (re-exported: the protocol's swap helpers)
    ReadsThrough,
    assign_keeping_layout,
    new_param,
    public_attributes,
)


@dataclasses.dataclass(frozen=True)
class ProjectionType:
    """How to read one projection module type (an entry of :func:`register_projection`).

    ``kernel`` is the attribute holding the kernel ``nnx.Param`` (``""``: the module holds no
    dense kernel, e.g. a quantized base); ``equation(module)`` its einsum string (input first,
    kernel second); ``bias`` the attribute of a bias added on the output's kernel axes (``None``:
    no bias); ``input_arg`` the position of the input in the module's call (gemma's
    ``Einsum.__call__(eqn, x)`` has ``input_arg=1``). A base without a dense kernel gives
    ``shape(module)`` (the kernel shape its equation reads), ``dense(module)`` (its weight as the
    fp32 matrix view ``[in, out]``, e.g. dequantized) and, when it can hold a new weight the same
    way, ``requantize(module, matrix [in, out])`` (a new module of the same kind and settings);
    ``method`` names its kind (``"nf4"``, ``"rtn"``, ...).
    """

    name: str
    kernel: str
    equation: Callable[[Any], str]
    bias: str | None = None
    input_arg: int = 0
    shape: Callable[[Any], tuple] | None = None
    dense: Callable[[Any], Any] | None = None
    requantize: Callable[[Any, Any], Any] | None = None
    method: str = ""

    @property
    def frozen(self) -> bool:
        """Whether the base holds no dense kernel (an adapter cannot be folded into it in place:
        :func:`lowrank_jax.nn.merge_adapters` merges into fp or re-quantizes)."""
        return not self.kernel


def _linear_general_equation(m) -> str:
    if len(m.batch_axis):
        raise ValueError("nnx.LinearGeneral with batch_axis is not one projection [in, out] "
                         "(its kernel holds a batch axis); leave it out of the rule.")
    n_in = len(m.in_features)
    axis = tuple(m.axis) if isinstance(m.axis, (tuple, list)) else (m.axis,)
    if tuple(axis) != tuple(range(-n_in, 0)):
        raise ValueError(
            f"nnx.LinearGeneral(axis={m.axis!r}): only trailing, increasing negative axes "
            f"(axis={tuple(range(-n_in, 0))}) are supported as a projection; register a custom "
            "view with lowrank_jax.nn.register_projection.")
    letters = string.ascii_lowercase
    ins, outs = letters[:n_in], letters[n_in:n_in + len(m.out_features)]
    return f"...{ins},{ins}{outs}->...{outs}"


def _einsum_equation(m) -> str:
    if getattr(m, "einsum_str", None) is None:
        raise ValueError(
            "nnx.Einsum without a constructor einsum_str: its kernel layout is only known at call "
            "time; construct it with einsum_str=... or register it with register_projection.")
    return m.einsum_str


PROJECTION_TYPES: dict[type, ProjectionType] = {
    nnx.Linear: ProjectionType("nnx.Linear", "kernel", lambda m: "...i,io->...o", "bias"),
    nnx.LinearGeneral: ProjectionType("nnx.LinearGeneral", "kernel", _linear_general_equation,
                                      "bias"),
    nnx.Einsum: ProjectionType("nnx.Einsum", "kernel", _einsum_equation, "bias"),
}
#: attribute names duck typing looks for: the einsum string, then the kernel
EQUATION_ATTRS = ("einsum_str", "equation", "eqn")
KERNEL_ATTRS = ("kernel", "w", "weight")
#: types that are never projections themselves (adapters and factorized layers register here)
NOT_PROJECTIONS: list[type] = []


def register_projection(cls: type, *, kernel: str | None = "kernel",
                        equation: str | Callable | None = None, bias: str | None = None,
                        input_arg: int = 0, shape: Callable | None = None,
                        dense: Callable | None = None, requantize: Callable | None = None,
                        method: str = "") -> None:
    """Declare that modules of type ``cls`` are projections (the one registration hook).

    Every layer kind the library adapts, factorizes, quantizes or merges plugs in here: a user's
    einsum module, and the quantized linears of :mod:`lowrank_jax.quant` (which register
    themselves when they are defined, so ``lowrank_jax.nn`` never imports ``quant``).

    Args:
        cls: the module class (matched exactly, not its subclasses).
        kernel: the attribute holding the kernel ``nnx.Param``; ``None`` for a base without a
            dense kernel (then give ``shape`` and ``dense``).
        equation: the einsum string (``'BTD,DNH->BTNH'``), or ``module -> str`` when it differs
            per instance.
        bias: the attribute of a bias over the output's kernel axes, if any.
        input_arg: the position of the input among the call's positional arguments.
        shape: ``module -> kernel shape`` (a base without a kernel).
        dense: ``module -> [in, out]`` fp32 matrix view of its weight (a base without a kernel).
        requantize: ``(module, matrix [in, out]) -> module`` of the same kind and settings
            holding ``matrix`` (lets ``merge_adapters(target="quantized")`` merge into it).
        method: the name of the base's kind (reported by merges).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> class Proj(nnx.Module):  # gemma-style: the equation comes at call time
        ...     def __init__(self, shape):
        ...         self.w = nnx.Param(jnp.ones(shape))
        ...     def __call__(self, eqn, x):
        ...         return jnp.einsum(eqn, x, self.w[...])
        >>> register_projection(Proj, kernel="w", equation="BTD,NDH->BTNH", input_arg=1)
        >>> projection_view(Proj((2, 4, 3))).out_shape
        (2, 3)
    """
    if equation is None:
        raise ValueError("register_projection: pass equation= (an einsum string or a function "
                         "module -> einsum string).")
    if not kernel and (shape is None or dense is None):
        raise ValueError(f"register_projection({cls.__name__}): a type without a kernel "
                         "attribute needs shape= (module -> kernel shape) and dense= (module -> "
                         "[in, out] matrix).")
    fn = equation if callable(equation) else (lambda _m, e=equation: e)
    PROJECTION_TYPES[cls] = ProjectionType(cls.__name__, kernel or "", fn, bias, input_arg,
                                           shape, dense, requantize, method)


def _duck_type(module) -> ProjectionType | None:
    eq_attr = next((a for a in EQUATION_ATTRS if isinstance(getattr(module, a, None), str)), None)
    k_attr = next((a for a in KERNEL_ATTRS if isinstance(getattr(module, a, None), nnx.Param)),
                  None)
    if eq_attr is None or k_attr is None:
        return None
    bias = "bias" if isinstance(getattr(module, "bias", None), nnx.Param) else None
    return ProjectionType(type(module).__name__, k_attr, lambda m, a=eq_attr: getattr(m, a), bias)


def projection_type(module) -> ProjectionType | None:
    """The :class:`ProjectionType` of ``module``, or ``None`` when it is not a projection.

    Looked up in order: the registry (exact type), a ``projection_view()`` method of the module
    itself (how a layer with a non-dense base, e.g. a quantized one, declares its layout), duck
    typing (a kernel ``nnx.Param`` plus an einsum string attribute)."""
    cls = type(module)
    if cls in NOT_PROJECTIONS or not isinstance(module, nnx.Module):
        return None
    if cls in PROJECTION_TYPES:
        return PROJECTION_TYPES[cls]
    if callable(getattr(cls, "projection_view", None)):
        return ProjectionType(
            cls.__name__, "", lambda m: m.projection_view().equation,
            shape=lambda m: m.projection_view().kernel_shape, dense=lambda m: m.dense_matrix(),
            requantize=(lambda m, w: m.requantized(w)) if hasattr(cls, "requantized") else None)
    return _duck_type(module)


def is_projection(module) -> bool:
    """Whether ``module`` is a projection the protocol can read."""
    return projection_type(module) is not None


def projection_view(module, where: str = "") -> ProjectionView:
    """The :class:`ProjectionView` of a projection module (clear error when it is not one)."""
    kind = projection_type(module)
    if kind is None:
        raise ValueError(
            f"{where}{type(module).__name__} is not a projection: the protocol reads nnx.Linear, "
            "nnx.LinearGeneral, nnx.Einsum and modules with a kernel nnx.Param "
            f"({'/'.join(KERNEL_ATTRS)}) and an einsum string ({'/'.join(EQUATION_ATTRS)}); "
            "declare others with lowrank_jax.nn.register_projection.")
    if not kind.kernel:
        if callable(getattr(type(module), "projection_view", None)):
            return module.projection_view()
        shape = kind.shape(module)
    else:
        shape = getattr(module, kind.kernel)[...].shape
    return ProjectionView.from_equation(kind.equation(module), shape, where or f"{kind.name}: ")


def projection_kernel(module):
    """The kernel ``nnx.Param`` of a projection (``None`` for one that declares its own view and
    holds no dense kernel, e.g. a quantized projection)."""
    kind = projection_type(module)
    return getattr(module, kind.kernel) if kind.kernel else None


def projection_bias(module):
    """The bias ``nnx.Param`` of a projection, or ``None``."""
    kind = projection_type(module)
    return None if kind.bias is None else getattr(module, kind.bias, None)


def dense_matrix(module, dtype=None):
    """The one dense-weight accessor: a projection's weight as the matrix ``[in, out]`` of its
    :class:`ProjectionView`.

    A dense projection gives its kernel regrouped (a transpose and a reshape); a base without a
    kernel its registered ``dense`` (a quantized one dequantized, fp32); a layer that computes
    its own (a factorized projection: ``a @ b``; an adapted layer: its base's weight, without the
    adapter) its ``dense_matrix()`` method.

    Args:
        module: the projection.
        dtype: the result's dtype (default: what the layer holds, e.g. its kernel's dtype).

    Example::

        >>> from flax import nnx
        >>> o = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=nnx.Rngs(0))
        >>> dense_matrix(o).shape
        (8, 8)
    """
    if callable(getattr(type(module), "dense_matrix", None)):
        matrix = module.dense_matrix()
    else:
        kind = projection_type(module)
        if kind is None:
            projection_view(module)  # raises the clear error
        if kind.dense is not None:
            matrix = kind.dense(module)
        else:
            matrix = projection_view(module).to_matrix(projection_kernel(module)[...])
    return matrix if dtype is None else jnp.asarray(matrix, dtype)


def set_kernel_from_matrix(module, matrix) -> None:
    """Write a matrix ``[in, out]`` into a projection's kernel (in its own layout, dtype and
    sharding)."""
    assign_keeping_layout(projection_kernel(module), projection_view(module).to_kernel(matrix))


def module_path(path: tuple) -> str:
    """``('layers', 3, 'mlp', 'up_proj')`` -> ``'layers/3/mlp/up_proj'``."""
    return "/".join(str(p) for p in path)


def outermost_projections(model: nnx.Module, also: tuple[type, ...] = ()):
    """``[(path, module)]`` of the projections of ``model`` that no other projection (nor
    module of a type in ``also``, nor adapted layer) holds: the quantized linear inside a
    :class:`~lowrank_jax.quant.QuantizedProjection`, or an adapter's base, is part of it."""
    found = [(p, m) for p, m in nnx.iter_modules(model)
             if is_projection(m) or isinstance(m, also + tuple(NOT_PROJECTIONS))]
    outer = {p for p, _ in found}
    return [(p, m) for p, m in found if not any(p[:i] in outer for i in range(len(p)))
            and (is_projection(m) or isinstance(m, also))]


def projection_paths(model: nnx.Module) -> list[str]:
    """Paths of every projection of ``model`` (not yet adapted, factorized or quantized): the
    layers :func:`lowrank_jax.nn.apply_lora` can adapt, in model order."""
    return [module_path(p) for p, m in outermost_projections(model)]


def matched_projections(model: nnx.Module, patterns, where: str, *,
                        skip: tuple[type, ...] = ()) -> list[tuple[tuple, str, Any, Any]]:
    """``[(path, name, module, pattern)]`` of every projection whose ``/`` path a pattern
    matches (``re.search``; the first matching pattern of ``patterns`` wins).

    Projections that are instances of ``skip`` are not candidates. A pattern that matches no
    projection raises one ``ValueError`` (prefixed ``where``) listing the projections there are.

    Example::

        >>> from flax import nnx
        >>> class Block(nnx.Module):
        ...     def __init__(self):
        ...         self.q_proj = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        ...         self.up = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        >>> [(name, pattern) for _, name, _, pattern in
        ...  matched_projections(Block(), ["q_proj", "up"], "demo")]
        [('q_proj', 'q_proj'), ('up', 'up')]
    """
    import re

    candidates = [(p, m) for p, m in outermost_projections(model, skip)
                  if not isinstance(m, skip)]
    hits = {k: 0 for k in patterns}
    found = []
    for path, module in candidates:
        name = module_path(path)
        pattern = next((k for k in patterns if re.search(k, name)), None)
        if pattern is not None:
            hits[pattern] += 1
            found.append((path, name, module, pattern))
    missing = [k for k, n in hits.items() if n == 0]
    if missing:
        shown = [module_path(p) for p, _ in candidates][:12]
        raise ValueError(f"{where}: rule {missing[0]!r} matches no projection; projections: "
                         f"{shown or '(none)'}")
    return found


def set_child(model: nnx.Module, path: tuple, new: Any) -> None:
    """Replace the sub-module at ``path`` (attribute names and list indices) by ``new``."""
    parent = model
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    last = path[-1]
    if isinstance(last, int):
        parent[last] = new
    else:
        setattr(parent, last, new)


def kernel_axis_names(module) -> tuple | None:
    """The logical axis names of a projection's kernel (its ``out_sharding`` metadata, one name
    or ``None`` per kernel axis), or ``None`` when it carries none. A base without a kernel (a
    quantized one) gives the names it kept from the kernel it replaced (``kernel_axes``)."""
    kind = projection_type(module)
    if kind is not None and kind.kernel:
        names = getattr(module, kind.kernel).get_metadata().get("out_sharding")
    else:
        names = getattr(module, "kernel_axes", None)
    return tuple(names) if names else None


def factor_axis_names(names: tuple | None, view: ProjectionView) -> tuple[tuple, tuple]:
    """Logical axes of the factors ``A [in, r]`` and ``B [r, out]`` over ``view`` from the
    kernel's axis names: ``A`` takes the name of the leading contracted axis, ``B`` that of the
    leading free axis (the flattened axis is sharded like its leading component: contiguous
    blocks), the rank axis is never sharded. ``((None, None), (None, None))`` without names.

    Example::

        >>> from flax import nnx
        >>> view = ProjectionView.from_equation("BTD,DNH->BTNH", (8, 2, 4))
        >>> factor_axis_names(("embed", "heads", "kv"), view)
        (('embed', None), (None, 'heads'))
    """
    if not names or len(names) != len(view.kernel_shape):
        return (None, None), (None, None)
    first = lambda axes: next((names[a] for a in axes if names[a] is not None), None)  # noqa: E731
    return (first(view.in_axes), None), (None, first(view.out_axes))


class DenseProjection(ReadsThrough, nnx.Module):
    """A plain projection ``einsum(equation, x, kernel) (+ bias)``: what a merge writes back for
    a projection whose base was quantized (the original module type cannot be rebuilt; its
    public attributes read through, see :class:`ReadsThrough`).

    Example::

        >>> import jax.numpy as jnp
        >>> p = DenseProjection("BTD,DNH->BTNH", jnp.ones((4, 2, 3)))
        >>> p(jnp.ones((1, 5, 4))).shape
        (1, 5, 2, 3)
    """

    def __init__(self, equation: str, kernel, bias=None, *, replaced_attributes: tuple = (),
                 replaced_type: str | None = None, kernel_axes: tuple | None = None):
        self.view = ProjectionView.from_equation(equation, jnp.shape(kernel), "DenseProjection: ")
        self.equation = self.view.equation
        self.replaced_attributes, self.replaced_type = tuple(replaced_attributes), replaced_type
        self.kernel = new_param(nnx.Param, jnp.asarray(kernel), kernel_axes)
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)

    def __call__(self, inputs):
        y = self.view.apply_kernel(inputs, self.kernel[...].astype(jnp.result_type(inputs)))
        if self.bias is not None:
            y = y + jnp.reshape(self.bias[...], self.view.bias_shape(y.ndim))
        return y


__all__ = ["DenseProjection", "NOT_PROJECTIONS", "PROJECTION_TYPES", "ProjectionType",
           "ProjectionView", "ReadsThrough", "assign_keeping_layout", "dense_matrix",
           "factor_axis_names", "is_projection", "kernel_axis_names", "matched_projections",
           "module_path", "new_param", "outermost_projections", "projection_bias",
           "projection_kernel",
           "projection_paths", "projection_type", "projection_view", "public_attributes",
           "register_projection", "set_child", "set_kernel_from_matrix"]
