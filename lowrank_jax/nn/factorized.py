"""Natively low-rank dense layers: W = a @ b, never materialised in the forward pass."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from lowrank_jax.nn.projection import ProjectionView, ReadsThrough, public_attributes

default_kernel_init = nnx.initializers.lecun_normal()


class LowRankFactor(nnx.Param):
    """A factor of a natively low-rank weight (``a`` is ``[in, rank]``, ``b`` is ``[rank, out]``).

    Optimizers find factor pairs with ``nnx.state(model, LowRankFactor)``; the metadata ``role``
    is ``"a"`` or ``"b"``.
    """


def check_rank(rank: int, in_features: int, out_features: int, where: str = "") -> None:
    """Raise a clear ``ValueError`` unless ``1 <= rank <= min(in_features, out_features)``."""
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
        raise ValueError(f"{where}rank must be a positive int, got {rank!r}.")
    limit = min(in_features, out_features)
    if rank < 1 or rank > limit:
        raise ValueError(
            f"{where}rank={rank} is invalid for a [{in_features}, {out_features}] weight: "
            f"it must lie in [1, {limit}] (min(in, out)). Lower the rank or the rank ratio."
        )


def balanced_factors(kernel: Float[Array, "m n"], rank: int):
    """Top-``rank`` SVD of ``kernel`` split evenly: ``a = U S^1/2``, ``b = S^1/2 Vᵀ``."""
    u, s, vt = jnp.linalg.svd(kernel.astype(jnp.float32), full_matrices=False)
    root = jnp.sqrt(s[:rank])
    return u[:, :rank] * root[None, :], root[:, None] * vt[:rank]


class FactorizedLinear(ReadsThrough, nnx.Module):
    """A linear layer stored as two thin factors, ``y = (x @ a) @ b (+ bias)``.

    The dense weight ``W = a @ b`` is never formed in ``__call__``, so a rank-``r`` layer costs
    ``r·(in + out)`` parameters and FLOPs per token instead of ``in·out``.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> layer = FactorizedLinear(16, 8, 4, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 16))).shape
        (2, 8)

    Args:
        in_features: input size.
        out_features: output size.
        rank: inner size ``r``, ``1 <= r <= min(in, out)``.
        use_bias: add a bias of shape ``[out]``.
        init: ``"svd_of_dense"`` (balanced factors from the top-r SVD of a dense init, so
            ``‖a‖₂ = ‖b‖₂ = √σ₁``) or ``"orthogonal"`` (semi-orthogonal factors scaled so that
            ``a @ b`` has the dense init's Frobenius scale).
        dtype: compute dtype (``None`` keeps the promoted dtype).
        param_dtype: storage dtype of the factors.
        kernel_init: the dense initializer that ``svd_of_dense`` factorizes.
        rngs: random keys.

    References:
        Janson et al, `Stabilizing Native Low-Rank LLM Pretraining
        <https://arxiv.org/abs/2602.12429>`_, 2026.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        use_bias: bool = False,
        init: Literal["svd_of_dense", "orthogonal"] = "svd_of_dense",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init=default_kernel_init,
        bias_init=nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
        a_metadata: dict | None = None,
        b_metadata: dict | None = None,
    ):
        check_rank(rank, in_features, out_features, "FactorizedLinear: ")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.dtype, self.param_dtype = dtype, param_dtype
        key = rngs.params()
        if init == "svd_of_dense":
            dense = kernel_init(key, (in_features, out_features), jnp.float32)
            a, b = balanced_factors(dense, rank)
        elif init == "orthogonal":
            ka, kb = jax.random.split(key)
            orth = nnx.initializers.orthogonal()
            a = orth(ka, (in_features, rank), jnp.float32)
            b = orth(kb, (rank, out_features), jnp.float32)
            # Scale so a @ b has the Frobenius norm of a lecun-normal dense init.
            target = jnp.sqrt(out_features * 1.0)  # E‖W‖_F² = in·out/in = out
            scale = jnp.sqrt(target / jnp.sqrt(rank * 1.0))
            a, b = a * scale, b * scale
        else:
            raise ValueError(
                f"FactorizedLinear: unknown init={init!r}; use 'svd_of_dense' or 'orthogonal'."
            )
        self.a = LowRankFactor(a.astype(param_dtype), role="a", **(a_metadata or {}))
        self.b = LowRankFactor(b.astype(param_dtype), role="b", **(b_metadata or {}))
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
        else:
            self.bias = nnx.data(None)

    @classmethod
    def from_dense(cls, kernel: Float[Array, "m n"], rank: int, bias=None, *, rngs=None):
        """Best rank-``rank`` factorization (truncated SVD, balanced) of an existing kernel."""
        m, n = kernel.shape
        layer = cls(m, n, rank, use_bias=bias is not None, rngs=rngs or nnx.Rngs(0),
                    param_dtype=kernel.dtype)
        a, b = balanced_factors(kernel, rank)
        layer.a[...] = a.astype(kernel.dtype)
        layer.b[...] = b.astype(kernel.dtype)
        if bias is not None:
            layer.bias[...] = bias
        return layer

    def dense_matrix(self) -> Float[Array, "m n"]:
        """The equivalent dense weight ``[in, out]``: ``a @ b`` (for analysis and export, never
        formed in the forward)."""
        return self.a[...] @ self.b[...]

    def __call__(self, inputs: Float[ArrayLike, "... in"]) -> Float[Array, "... out"]:
        a, b = self.a[...], self.b[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, a, b, bias = nnx.nn.dtypes.promote_dtype((inputs, a, b, bias), dtype=self.dtype)
        y = (inputs @ a) @ b
        if bias is not None:
            y = y + bias
        return y


class FactorizedProjection(ReadsThrough, nnx.Module):
    """A projection of any layout stored as two thin factors over its matrix view:
    ``y = unflat(flat(x) a b) (+ bias)``, never forming ``a b``.

    What :func:`factorize` puts in place of an ``nnx.LinearGeneral``, ``nnx.Einsum`` or user
    einsum module (an ``nnx.Linear`` becomes a :class:`FactorizedLinear`). ``a`` ``[in, rank]``
    and ``b`` ``[rank, out]`` are :class:`LowRankFactor` s, so Spectron's pair finder sees them.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> o = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=nnx.Rngs(0))
        >>> f = FactorizedProjection.from_projection(o, rank=8)
        >>> x = jnp.ones((1, 3, 2, 4))
        >>> bool(jnp.allclose(f(x), o(x), atol=1e-5))
        True

    Args:
        equation: the einsum of the projection (input, kernel -> output).
        kernel_shape: the dense kernel's shape (the factors span its matrix view).
        a, b: the factors ``[in, rank]``, ``[rank, out]``.
        bias: an optional bias of the output's kernel axes.
    """

    def __init__(self, equation: str, kernel_shape, a, b, bias=None, *, dtype: Any = None,
                 replaced_attributes: tuple = (), replaced_type: str | None = None):
        self.replaced_attributes, self.replaced_type = tuple(replaced_attributes), replaced_type
        self.view = ProjectionView.from_equation(equation, kernel_shape, "FactorizedProjection: ")
        self.equation = self.view.equation
        if a.shape[0] != self.view.in_features or b.shape[1] != self.view.out_features:
            raise ValueError(
                f"FactorizedProjection: factors {a.shape}, {b.shape} do not span the kernel "
                f"{tuple(kernel_shape)} of {equation!r} (need [{self.view.in_features}, r] and "
                f"[r, {self.view.out_features}]).")
        self.rank, self.dtype = int(a.shape[1]), dtype
        self.a = LowRankFactor(jnp.asarray(a), role="a")
        self.b = LowRankFactor(jnp.asarray(b), role="b")
        self.bias = nnx.Param(jnp.asarray(bias)) if bias is not None else nnx.data(None)

    @classmethod
    def from_projection(cls, module, rank: int, *, init: str = "svd") -> "FactorizedProjection":
        """Factorize a projection module (see :func:`factorize` for ``init``)."""
        from lowrank_jax.nn.projection import (
            dense_matrix, projection_bias, projection_kernel, projection_view)

        view = projection_view(module)
        check_rank(rank, view.in_features, view.out_features, "factorize: ")
        matrix = dense_matrix(module)
        a, b = factor_matrix(matrix, rank, init=init)
        bias = projection_bias(module)
        if bias is not None:
            bias = bias[...]
            if tuple(bias.shape) != view.out_shape:
                raise ValueError(
                    f"factorize: the bias of {type(module).__name__} has shape {bias.shape}, not "
                    f"the output's kernel axes {view.out_shape}; only such biases are kept.")
        dtype = projection_kernel(module)[...].dtype
        return cls(view.equation, view.kernel_shape, a.astype(dtype), b.astype(dtype), bias,
                   replaced_attributes=public_attributes(module),
                   replaced_type=type(module).__name__)

    def dense_matrix(self):
        """The equivalent dense weight as the matrix view ``[in, out]``: ``a @ b`` (the kernel
        in the original layout is ``self.view.to_kernel(self.dense_matrix())``)."""
        return self.a[...] @ self.b[...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense kernel's shape (what the replaced einsum module's ``.shape`` was)."""
        return dict(self.replaced_attributes).get("shape", self.view.kernel_shape)

    def __call__(self, inputs):
        a, b = self.a[...], self.b[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, a, b, bias = nnx.nn.dtypes.promote_dtype((inputs, a, b, bias), dtype=self.dtype)
        y = self.view.apply_factors(inputs, a, b)
        if bias is not None:
            y = y + jnp.reshape(bias, self.view.bias_shape(y.ndim))
        return y


def factor_matrix(matrix, rank: int, *, init: str = "svd", key=None):
    """Factors ``a [in, rank]``, ``b [rank, out]`` of a matrix: ``"svd"`` (balanced top-``rank``
    SVD, the best rank-``rank`` approximation) or ``"orthogonal"`` (semi-orthogonal random
    factors with the matrix's shape scale: for from-scratch training of a model whose kernels
    are not loaded yet). An all-zero matrix with ``"svd"`` is refused (its factors would be zero
    and receive zero gradients)."""
    matrix = jnp.asarray(matrix, jnp.float32)
    if init == "svd":
        if not bool(jnp.any(matrix != 0)):
            raise ValueError(
                "factorize: the kernel is all zeros (a model whose checkpoint is not loaded "
                "yet?); its SVD factors would be zero and never train. Load the weights first, "
                "or pass init='orthogonal' to pretrain from scratch.")
        if not bool(jnp.all(jnp.isfinite(matrix))):
            raise ValueError("factorize: the kernel holds NaN or inf values; fix the checkpoint.")
        return balanced_factors(matrix, rank)
    if init == "orthogonal":
        key = jax.random.PRNGKey(0) if key is None else key
        ka, kb = jax.random.split(key)
        m, n = matrix.shape
        orth = nnx.initializers.orthogonal()
        scale = jnp.sqrt(jnp.sqrt(n * 1.0) / jnp.sqrt(rank * 1.0))
        return orth(ka, (m, rank), jnp.float32) * scale, orth(kb, (rank, n), jnp.float32) * scale
    raise ValueError(f"factorize: unknown init={init!r}; use 'svd' or 'orthogonal'.")


def factorize(model: nnx.Module, rules, *, rank: int | None = None,
              rank_ratio: float | None = None, init: str = "svd") -> dict[str, dict]:
    """Make the matched projections of any NNX model natively low-rank (in place).

    Each projection whose path a rule matches (a regex ``re.search``-ed in the ``/`` path, a
    list of them, or ``{regex: rank}``) is replaced by its factorized form — an ``nnx.Linear``
    by a :class:`FactorizedLinear`, any other projection by a :class:`FactorizedProjection` —
    with ``W ≈ a b`` from the balanced truncated SVD of its ``[in, out]`` matrix view, so
    :func:`lowrank_jax.optim.spectron_with_adamw` trains the model with its factor pairs.

    .. math:: a = U_r S_r^{1/2},\\quad b = S_r^{1/2} V_r^\\top,\\qquad
              \\varepsilon = \\|W - a b\\|_F / \\|W\\|_F

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> class Block(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.q = nnx.Einsum("BTD,DNH->BTNH", (16, 2, 8), rngs=rngs)
        ...         self.up = nnx.Linear(16, 32, rngs=rngs)
        >>> report = factorize(Block(nnx.Rngs(0)), r"q|up", rank_ratio=0.5)
        >>> {p: r["rank"] for p, r in report.items()}
        {'q': 8, 'up': 8}

    Args:
        model: any NNX module; modified in place.
        rules: a regex, a list of regexes, or ``{regex: rank}``.
        rank: one rank for every match (or from the mapping).
        rank_ratio: rank = ``max(1, round(ratio · min(in, out)))`` per projection.
        init: ``"svd"`` (the dense weights must be loaded) or ``"orthogonal"`` (from scratch).

    Returns:
        ``{path: {"rank", "in", "out", "error", "params_before", "params_after"}}`` where
        ``error`` is the relative Frobenius error of the factorization (0 at full rank).

    Raises:
        ValueError: a rule that matches no projection (the message lists them), no rank given,
            a rank out of range, an all-zero kernel with ``init="svd"``.
    """
    from lowrank_jax.nn.projection import (
        dense_matrix, matched_projections, projection_view, set_child)

    if isinstance(rules, str):
        patterns = {rules: rank}
    elif isinstance(rules, dict):
        patterns = {k: int(v) for k, v in rules.items()}
    else:
        patterns = {r: rank for r in rules}
    if rank_ratio is None and any(v is None for v in patterns.values()):
        raise ValueError("factorize: give rank=, rank_ratio= or a {regex: rank} mapping.")
    if rank_ratio is not None and not (0.0 < float(rank_ratio) <= 1.0):
        raise ValueError(f"factorize: rank_ratio={rank_ratio!r} must lie in (0, 1].")
    report = {}
    for path, name, module, pattern in matched_projections(model, list(patterns), "factorize"):
        view = projection_view(module, f"factorize({name}): ")
        r = patterns[pattern]
        if rank_ratio is not None and r is None:
            r = max(1, int(round(float(rank_ratio) * min(view.in_features, view.out_features))))
        if type(module) is nnx.Linear:
            check_rank(r, view.in_features, view.out_features, f"factorize({name}): ")
            w = dense_matrix(module)
            a, b = factor_matrix(w, r, init=init)
            # the layer's shell by shape only: no random init to throw away
            new = nnx.eval_shape(lambda: FactorizedLinear(
                view.in_features, view.out_features, r, use_bias=module.bias is not None,
                dtype=module.dtype, param_dtype=module.param_dtype, rngs=nnx.Rngs(0)))
            new.a.set_value(a.astype(module.param_dtype))
            new.b.set_value(b.astype(module.param_dtype))
            if module.bias is not None:
                new.bias.set_value(module.bias[...])
            new.replaced_attributes = public_attributes(module)
            new.replaced_type = type(module).__name__
        else:
            w = dense_matrix(module)
            new = FactorizedProjection.from_projection(module, r, init=init)
        w = jnp.asarray(w, jnp.float32)
        approx = new.a[...].astype(jnp.float32) @ new.b[...].astype(jnp.float32)
        norm = float(jnp.linalg.norm(w))
        error = float(jnp.linalg.norm(w - approx)) / norm if norm > 0 else 0.0
        report[name] = {"rank": r, "in": view.in_features, "out": view.out_features,
                        "error": error if init == "svd" else float("nan"),
                        "params_before": view.in_features * view.out_features,
                        "params_after": r * (view.in_features + view.out_features)}
        set_child(model, path, new)
    return report
