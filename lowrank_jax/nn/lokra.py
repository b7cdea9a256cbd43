"""LoKRA / LoKRA+: Kruskal-rank regularised LoRA, and a Khatri–Rao factored adapter.

LoRA's update ``ΔW = B A`` has matrix rank ≤ r, but its channels may still be near-duplicates.
The Kruskal rank ``k(M)`` (largest k such that *every* k columns are independent) measures that
diversity; with full-rank factors, ``k`` of the update's input channels is ``k(A)`` and of its
output channels ``k(Bᵀ)``. LoKRA adds a penalty pushing up ``k(A)`` and ``k(Bᵀ)``; LoKRA+ builds
the factors as Khatri–Rao products, whose k-rank has the lower bound
``k(P ⊙ Q) ≥ min(k(P) + k(Q) − 1, n)``.

In lowrank_jax's layout (``lora_a`` ``[in, r]``, ``lora_b`` ``[r, out]``) the channel-code
matrices are ``A = lora_aᵀ`` ``[r, in]`` and ``Bᵀ = lora_b`` ``[r, out]``.

The Kruskal-rank tools (exact rank, coherence, Khatri–Rao product, the penalty) live in
:mod:`lowrank_jax.core.kruskal` and are re-exported here.

DERIVED (the paper and its code were not readable): the penalty formula (frame potential or
smooth max coherence), applying it to both ``A`` and ``Bᵀ``, skipping a still-zero factor,
LoKRA+'s parameterisation (candidate P1 of the spec: ``A = A1 ⊙ A2``, ``Bᵀ = B1ᵀ ⊙ B2ᵀ``) and its
initialisation (``B2 = 0`` so the update starts at zero).

References:
    AMD ROCm blog, *LoKRA: Low Kruskal-Rank Adaptation* (ICML 2026),
    https://rocm.blogs.amd.com/artificial-intelligence/lokra/README.html ; Sidiropoulos & Bro,
    *On the uniqueness of multilinear decomposition of N-way arrays*, 2000 (Khatri–Rao bound);
    Albert et al, `KRAdapter <https://arxiv.org/abs/2508.00230>`_, 2025.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from lowrank_jax.core.kruskal import (  # the one Kruskal module
    PenaltyKind,
    coherence,
    khatri_rao,
    kruskal_penalty,
    kruskal_rank_exact,
)
from lowrank_jax.nn.factorized import check_rank
from lowrank_jax.nn.lora import lora_layers, lora_output
from lowrank_jax.nn.projection import new_param


def lokra_regularizer(model: nnx.Module, *, kind: PenaltyKind = "frame",
                      normalize: bool = True) -> Float[Array, ""]:
    """LoKRA's penalty summed over every LoRA adapter: ``Σ pen(lora_aᵀ) + pen(lora_b)``.

    With ``normalize`` the sum is divided by the number of adapters (so λ does not scale with
    depth). Add ``λ · lokra_regularizer(model)`` to the task loss (λ ~ 1e-3, DERIVED default).
    Works for :class:`~lowrank_jax.nn.LoRALinear` and :class:`LoKRAPlusLinear` (where it
    penalises the four Khatri–Rao factors).

    Example::

        >>> from flax import nnx
        >>> from lowrank_jax.nn import LoRALinear
        >>> class M(nnx.Module):
        ...     def __init__(self):
        ...         self.up = LoRALinear(8, 6, rank=2, rngs=nnx.Rngs(0))
        >>> float(lokra_regularizer(M())) >= 0.0
        True
    """
    terms = []
    for _, layer in lora_layers(model):
        terms.append(kruskal_penalty(layer.lora_a[...].T, kind=kind)
                     + kruskal_penalty(layer.lora_b[...], kind=kind))
    for _, layer in nnx.iter_modules(model):
        if isinstance(layer, LoKRAPlusLinear):
            terms.append(layer.regularizer(kind=kind))
    if not terms:
        raise ValueError("lokra_regularizer: the model has no LoRA adapter; add some with "
                         "apply_lora first.")
    total = sum(terms)
    return total / len(terms) if normalize else total


class LoKRAPlusLinear(nnx.Linear):
    """``nnx.Linear`` plus a Khatri–Rao factored adapter (LoKRA+, parameterisation P1, DERIVED).

    Not a :class:`~lowrank_jax.nn.LoRA` itself: its update is built from four factors
    (``A = A_1 ⊙ A_2``, ``Bᵀ = B_1ᵀ ⊙ B_2ᵀ``) with their own initialisation (``B_1`` random,
    ``B_2 = 0``) and scale ``alpha / (r1 r2)``, so the body differs; it shares the plumbing
    (``nnx.LoRAParam`` factors carrying the kernel's logical axes, the ``delta()`` / ``rank`` /
    ``scaling`` interface, :meth:`lora_factors` as the equivalent plain ``A``, ``B``).

    .. math::

        A = A_1 \\odot A_2 \\in \\mathbb R^{r_1 r_2 \\times in},\\quad
        B^\\top = B_1^\\top \\odot B_2^\\top \\in \\mathbb R^{r_1 r_2 \\times out},\\quad
        y = x W + s\\, x A^\\top B^\\top

    so ``rank(ΔW) ≤ r_1 r_2`` with ``(r_1 + r_2)(in + out)`` parameters, and
    ``k(A) ≥ min(k(A_1) + k(A_2) − 1, in)``. Params (``nnx.LoRAParam``): ``lora_a1`` ``[in, r1]``,
    ``lora_a2`` ``[in, r2]``, ``lora_b1`` ``[r1, out]``, ``lora_b2`` ``[r2, out]``. Init (DERIVED):
    ``A1, A2 ~ N(0, 1/√in)`` so ``A`` has LoRA-like scale, ``B1 ~ N(0, 1/√out)``, ``B2 = 0``
    (so ``ΔW = 0`` at init and ``B2``'s gradient is non-zero). ``s = alpha / (r1 r2)``.

    Example::

        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> layer = LoKRAPlusLinear(8, 6, rank1=2, rank2=2, rngs=nnx.Rngs(0))
        >>> layer.lora_factors()[0].shape, layer(jnp.ones((3, 8))).shape
        ((8, 4), (3, 6))

    Args:
        in_features, out_features: sizes, as ``nnx.Linear``.
        rank1, rank2: Khatri–Rao ranks; the update has rank ≤ ``rank1 · rank2``.
        alpha: scale numerator (defaults to ``rank1 · rank2``, scale 1).
        kwargs: everything else ``nnx.Linear`` takes.
    """

    def __init__(self, in_features: int, out_features: int, *, rank1: int, rank2: int,
                 alpha: float | None = None, rngs: nnx.Rngs, **linear_kwargs: Any):
        super().__init__(in_features, out_features, rngs=rngs, **linear_kwargs)
        rank = rank1 * rank2
        check_rank(rank, in_features, out_features, "LoKRAPlusLinear (rank1·rank2): ")
        self.rank1, self.rank2, self.rank = rank1, rank2, rank
        self.alpha = alpha
        self.scaling = float(rank if alpha is None else alpha) / rank
        pdt = self.param_dtype
        std_a = in_features ** -0.25
        # the factors carry the kernel's logical axes, as LoRA's (the rank axes unsharded)
        names = self.kernel.get_metadata().get("out_sharding")
        a_axes, b_axes = ((names[0], None), (None, names[1])) if names else (None, None)

        def factor(value, axes):
            return new_param(nnx.LoRAParam, value, axes, self.kernel)

        self.lora_a1 = factor(std_a * jax.random.normal(rngs.params(), (in_features, rank1), pdt),
                              a_axes)
        self.lora_a2 = factor(std_a * jax.random.normal(rngs.params(), (in_features, rank2), pdt),
                              a_axes)
        self.lora_b1 = factor(jax.random.normal(rngs.params(), (rank1, out_features), pdt)
                              / jnp.sqrt(out_features), b_axes)
        self.lora_b2 = factor(jnp.zeros((rank2, out_features), pdt), b_axes)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, *, rank1: int, rank2: int, rngs: nnx.Rngs,
                    alpha: float | None = None) -> "LoKRAPlusLinear":
        """Wrap an existing ``nnx.Linear`` (kernel and bias shared)."""
        layer = cls(linear.in_features, linear.out_features, rank1=rank1, rank2=rank2,
                    alpha=alpha, use_bias=linear.bias is not None, dtype=linear.dtype,
                    param_dtype=linear.param_dtype, rngs=rngs)
        layer.kernel, layer.bias = linear.kernel, linear.bias
        return layer

    def lora_factors(self) -> tuple[Float[Array, "in r"], Float[Array, "r out"]]:
        """The equivalent plain LoRA factors ``(lora_a [in, r1 r2], lora_b [r1 r2, out])``."""
        a = khatri_rao(self.lora_a1[...].T, self.lora_a2[...].T).T
        b = khatri_rao(self.lora_b1[...], self.lora_b2[...])
        return a, b

    def delta(self) -> Float[Array, "in out"]:
        """The dense update ``s · lora_a @ lora_b``."""
        a, b = self.lora_factors()
        return self.scaling * (a @ b)

    def regularizer(self, *, kind: PenaltyKind = "frame") -> Float[Array, ""]:
        """Kruskal penalty on the four factors' channel codes."""
        return (kruskal_penalty(self.lora_a1[...].T, kind=kind)
                + kruskal_penalty(self.lora_a2[...].T, kind=kind)
                + kruskal_penalty(self.lora_b1[...], kind=kind)
                + kruskal_penalty(self.lora_b2[...], kind=kind))

    def __call__(self, inputs: Float[ArrayLike, "... in"]):
        out = super().__call__(inputs)
        a, b = self.lora_factors()
        return out + lora_output(inputs, a, b, self.scaling, dtype=self.dtype)


__all__ = ["LoKRAPlusLinear", "coherence", "khatri_rao", "kruskal_penalty", "kruskal_rank_exact",
           "lokra_regularizer"]
