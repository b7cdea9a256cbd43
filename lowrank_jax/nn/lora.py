"""LoRA layers: a drop-in replacement for ``nnx.Linear`` with a low-rank adapter."""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from lowrank_jax.nn.factorized import check_rank

default_a_initializer = nnx.initializers.he_uniform()
default_b_initializer = nnx.initializers.zeros_init()

LoRAInit = Literal["standard", "pissa", "gaussian"]


def lora_scaling(rank: int, alpha: float | None, use_rslora: bool) -> float:
    """PEFT's scale: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA (alpha defaults to
    rank)."""
    alpha = float(rank if alpha is None else alpha)
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRALinear(nnx.Linear):
    """``nnx.Linear`` plus a low-rank adapter: ``y = x W + b + s · dropout(x) A B``.

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
        rank: adapter rank ``r`` (``1 <= r <= min(in, out)``).
        alpha: scale numerator (PEFT's ``lora_alpha``); defaults to ``rank`` (scale 1).
        use_rslora: scale by ``alpha / sqrt(rank)`` (rank-stabilised LoRA).
        dropout: dropout rate on the adapter's input (needs ``rngs`` with a ``dropout`` stream
            at call time unless ``deterministic``).
        init: ``"standard"`` (A he-uniform, B zero), ``"gaussian"`` (A normal(1/r), B zero) or
            ``"pissa"`` (A, B from the top-r SVD of the kernel; the kernel keeps the residual,
            so the layer's output is unchanged).
        kwargs: everything else ``nnx.Linear`` takes (``use_bias``, ``dtype``, ``param_dtype``,
            ``kernel_init``, ``rngs``, ...).

    References:
        Hu et al, `LoRA <https://arxiv.org/abs/2106.09685>`_, 2021; Kalajdzievski,
        `rsLoRA <https://arxiv.org/abs/2312.03732>`_, 2023; Meng et al,
        `PiSSA <https://arxiv.org/abs/2404.02948>`_, 2024.
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
        super().__init__(in_features, out_features, rngs=rngs, **linear_kwargs)
        check_rank(rank, in_features, out_features, "LoRALinear: ")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRALinear: dropout={dropout} must lie in [0, 1).")
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.merged = False
        pdt = self.param_dtype
        if init == "standard":
            a = a_initializer(rngs.params(), (in_features, rank), pdt)
        elif init == "gaussian":
            a = jax.random.normal(rngs.params(), (in_features, rank), pdt) / rank
        elif init == "pissa":
            a = jnp.zeros((in_features, rank), pdt)
        else:
            raise ValueError(
                f"LoRALinear: unknown init={init!r}; use 'standard', 'gaussian' or 'pissa' "
                "(more in lowrank_jax.nn.init)."
            )
        self.lora_a = nnx.LoRAParam(a)
        self.lora_b = nnx.LoRAParam(b_initializer(rngs.params(), (rank, out_features), pdt))
        self.lora_dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else nnx.data(None)
        if init == "pissa":
            self.init_pissa()

    @classmethod
    def from_linear(
        cls, linear: nnx.Linear, *, rank: int, rngs: nnx.Rngs, **kwargs
    ) -> "LoRALinear":
        """Wrap an existing ``nnx.Linear`` (its kernel and bias are shared, not copied)."""
        pissa = kwargs.get("init") == "pissa"
        if pissa:
            kwargs = {**kwargs, "init": "standard"}
        layer = cls(
            linear.in_features,
            linear.out_features,
            rank=rank,
            use_bias=linear.bias is not None,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            precision=linear.precision,
            rngs=rngs,
            **kwargs,
        )
        layer.kernel = linear.kernel
        layer.bias = linear.bias
        if pissa:
            layer.init_pissa()
        return layer

    def delta(self) -> Float[Array, "in out"]:
        """The adapter's dense update ``s · A B``."""
        return self.scaling * (self.lora_a[...] @ self.lora_b[...])

    def init_pissa(self) -> None:
        """PiSSA: A, B span the kernel's top-r singular triplets; the kernel keeps the residual."""
        w = self.kernel[...].astype(jnp.float32)
        u, s, vt = jnp.linalg.svd(w, full_matrices=False)
        r = self.rank
        root = jnp.sqrt(s[:r] / self.scaling)
        a = u[:, :r] * root[None, :]
        b = root[:, None] * vt[:r]
        self.lora_a[...] = a.astype(self.param_dtype)
        self.lora_b[...] = b.astype(self.param_dtype)
        self.kernel[...] = (w - self.scaling * (a @ b)).astype(self.param_dtype)

    def merge(self) -> None:
        """Fold the adapter into the kernel (``W += s A B``); the adapter then adds nothing."""
        if self.merged:
            raise ValueError("LoRALinear.merge: the adapter is already merged; unmerge first.")
        self.kernel[...] = (self.kernel[...] + self.delta()).astype(self.kernel[...].dtype)
        self.merged = True

    def unmerge(self) -> None:
        """Undo :meth:`merge` (``W -= s A B``)."""
        if not self.merged:
            raise ValueError("LoRALinear.unmerge: the adapter is not merged.")
        self.kernel[...] = (self.kernel[...] - self.delta()).astype(self.kernel[...].dtype)
        self.merged = False

    def __call__(self, inputs: Float[ArrayLike, "... in"], *, deterministic: bool | None = None):
        out = super().__call__(inputs)
        if self.merged:
            return out
        x = inputs
        if self.lora_dropout is not None:
            x = self.lora_dropout(x, deterministic=deterministic)
        a, b = self.lora_a[...], self.lora_b[...]
        x, a, b = nnx.nn.dtypes.promote_dtype((x, a, b), dtype=self.dtype)
        return out + self.scaling * ((x @ a) @ b)


class LoRAProjection(nnx.Module):
    """Any projection (``nnx.LinearGeneral``, ``nnx.Einsum``, a user einsum module) plus a LoRA
    adapter over its matrix view: ``y = base(x) + s · unflat(flat(x) A B)``.

    The base module is kept as it is (``base``) and called with the same arguments, so the
    wrapper keeps its call signature; ``lora_a`` ``[in, rank]`` and ``lora_b`` ``[rank, out]``
    are matrices over the grouped axes of :func:`lowrank_jax.nn.projection_view` (for an
    attention kernel ``[D, N, H]``: ``A [D, r]``, ``B [r, N·H]``), the layout PEFT stores.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> q = nnx.Einsum("BTD,DNH->BTNH", (8, 2, 4), rngs=nnx.Rngs(0))
        >>> layer = LoRAProjection(q, rank=2, rngs=nnx.Rngs(1))
        >>> x = jnp.ones((1, 3, 8))
        >>> layer.lora_b[...].shape, bool(jnp.allclose(layer(x), q(x)))
        ((2, 8), True)

    Args:
        base: a projection module (see :mod:`lowrank_jax.nn.projection`).
        rank, alpha, use_rslora, dropout, init: as :class:`LoRALinear` (``init="pissa"`` splits
            the top-``rank`` SVD of the matrix view off the base kernel; a quantized base refuses
            it).
        param_dtype: dtype of the adapter factors (default: the kernel's).
    """

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
        from lowrank_jax.nn.projection import projection_kernel, projection_view

        self.base = base
        self.view = projection_view(base, f"LoRAProjection({type(base).__name__}): ")
        self.in_features, self.out_features = self.view.in_features, self.view.out_features
        check_rank(rank, self.in_features, self.out_features, "LoRAProjection: ")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRAProjection: dropout={dropout} must lie in [0, 1).")
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.merged = False
        kernel = projection_kernel(base)
        kdt = jnp.float32 if kernel is None else kernel[...].dtype
        pdt = param_dtype or (kdt if jnp.issubdtype(kdt, jnp.floating) else jnp.float32)
        self.param_dtype = pdt
        if init in ("standard", "pissa"):
            a = a_initializer(rngs.params(), (self.in_features, rank), pdt)
        elif init == "gaussian":
            a = jax.random.normal(rngs.params(), (self.in_features, rank), pdt) / rank
        else:
            raise ValueError(f"LoRAProjection: unknown init={init!r}; use 'standard', "
                             "'gaussian' or 'pissa'.")
        self.lora_a = nnx.LoRAParam(a)
        self.lora_b = nnx.LoRAParam(b_initializer(rngs.params(), (rank, self.out_features), pdt))
        self.lora_dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else nnx.data(None)
        if init == "pissa":
            self.init_pissa()

    @property
    def kernel(self):
        """The base's kernel ``nnx.Param`` (in the base's own layout)."""
        from lowrank_jax.nn.projection import projection_kernel

        return projection_kernel(self.base)

    def delta(self) -> Float[Array, "in out"]:
        """The adapter's dense update ``s · A B`` over the matrix view ``[in, out]``."""
        return self.scaling * (self.lora_a[...] @ self.lora_b[...])

    def base_weight(self) -> Float[Array, "out in"]:
        """The base's fp32 weight ``[out, in]`` (the matrix view transposed; a quantized base is
        dequantized)."""
        base = self.base
        if hasattr(base, "dense_matrix"):
            return base.dense_matrix().astype(jnp.float32).T
        return self.view.kernel_matrix(self.kernel[...]).astype(jnp.float32).T

    def init_pissa(self) -> None:
        """PiSSA on the matrix view: A, B take the top-``rank`` singular triplets, the kernel
        keeps the residual (the output is unchanged)."""
        if hasattr(self.base, "dense_matrix"):
            raise ValueError("LoRAProjection: init='pissa' rewrites the base weight and is not "
                             "available on a quantized base; use 'standard' or 'gaussian'.")
        w = self.view.kernel_matrix(self.kernel[...]).astype(jnp.float32)
        u, s, vt = jnp.linalg.svd(w, full_matrices=False)
        root = jnp.sqrt(s[:self.rank] / self.scaling)
        a, b = u[:, :self.rank] * root[None, :], root[:, None] * vt[:self.rank]
        self.lora_a[...] = a.astype(self.param_dtype)
        self.lora_b[...] = b.astype(self.param_dtype)
        self._add_to_kernel(-self.scaling * (a @ b))

    def _add_to_kernel(self, matrix) -> None:
        kernel = self.kernel
        if hasattr(self.base, "dense_matrix"):
            raise ValueError(
                "LoRAProjection.merge: an adapter cannot be folded into a quantized base in "
                "place; use lowrank_jax.nn.merge.merge_adapters(model, target='fp' | "
                "'quantized').")
        w = self.view.kernel_matrix(kernel[...]).astype(jnp.float32) + matrix
        kernel[...] = self.view.matrix_kernel(w).astype(kernel[...].dtype)

    def merge(self) -> None:
        """Fold the adapter into the base kernel (``K += unflat(s A B)``)."""
        if self.merged:
            raise ValueError("LoRAProjection.merge: the adapter is already merged; unmerge "
                             "first.")
        self._add_to_kernel(self.delta().astype(jnp.float32))
        self.merged = True

    def unmerge(self) -> None:
        """Undo :meth:`merge`."""
        if not self.merged:
            raise ValueError("LoRAProjection.unmerge: the adapter is not merged.")
        self._add_to_kernel(-self.delta().astype(jnp.float32))
        self.merged = False

    def __call__(self, *args, deterministic: bool | None = None, **kwargs):
        from lowrank_jax.nn.projection import projection_type

        out = self.base(*args, **kwargs)
        if self.merged:
            return out
        if kwargs.get("einsum_str") not in (None, self.view.equation):
            raise ValueError(
                f"LoRAProjection: called with einsum_str={kwargs['einsum_str']!r} but the "
                f"adapter was built for {self.view.equation!r}.")
        kind = projection_type(self.base)
        x = jnp.asarray(args[kind.input_arg] if len(args) > kind.input_arg
                        else kwargs.get("inputs", kwargs.get("x")))
        if self.lora_dropout is not None:
            x = self.lora_dropout(x, deterministic=deterministic)
        a, b = self.lora_a[...], self.lora_b[...]
        h = self.view.apply_factors(x.astype(a.dtype), a, b)
        return (out + self.scaling * h.astype(out.dtype)).astype(out.dtype)
