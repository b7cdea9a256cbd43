"""Natively low-rank dense layers: W = a @ b, never materialised in the forward pass."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

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


class FactorizedLinear(nnx.Module):
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

    def dense_kernel(self) -> Float[Array, "m n"]:
        """The equivalent dense weight ``a @ b`` (for analysis and export, not the forward)."""
        return self.a[...] @ self.b[...]

    def __call__(self, inputs: Float[ArrayLike, "... in"]) -> Float[Array, "... out"]:
        a, b = self.a[...], self.b[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, a, b, bias = nnx.nn.dtypes.promote_dtype((inputs, a, b, bias), dtype=self.dtype)
        y = (inputs @ a) @ b
        if bias is not None:
            y = y + bias
        return y
