"""BaLoRA: re-project every LoRA pair onto the balanced manifold after each optimizer step.

LoRA's product is invariant to ``(L, R) -> (L G, G⁻¹ R)``; BaLoRA removes that invariance by
replacing each adapter pair with a *balanced* pair (``LᵀL = R Rᵀ``) with the same product after
every optimizer step. In lowrank_jax's layout the left factor is ``lora_a`` ``[in, r]`` and the
right factor ``lora_b`` ``[r, out]`` (``ΔK = s · lora_a @ lora_b``); the scale ``s`` stays outside.

References:
    Castin, Nadjahi, Ablin, Peyré, `Balanced LoRA: Removing Parameter Invariance to Accelerate
    Convergence <https://arxiv.org/abs/2605.31484>`_, ICML 2026.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

from lowrank_jax.optim.factors import (
    PairFn,
    find_pairs,
    flatten_by_path,
    has_unmasked_leaves,
    path_str,
    unflatten_by_path,
)
from lowrank_jax.optim.linalg import Numeric
from lowrank_jax.optim.linalg import gathered as _gathered
from lowrank_jax.optim.linalg import polar

BalanceMode = Literal["svd", "procrustes"]
LEFT_NAME, RIGHT_NAME = "lora_a", "lora_b"


class BaLoRAState(NamedTuple):
    """State of :func:`scale_by_balora`: only a step counter."""

    count: jax.Array  # shape=(), dtype=jnp.int32: optimizer steps seen so far


def _svd_balanced(left, right):
    """QR form of the reference projection: ``L' = Q₁ U Σ^½``, ``R' = Σ^½ Vᵀ Q₂ᵀ``."""
    q1, t1 = jnp.linalg.qr(left)
    q2, t2 = jnp.linalg.qr(right.T)
    u, sigma, vt = jnp.linalg.svd(t1 @ t2.T)
    root = jnp.sqrt(sigma)
    return (q1 @ u) * root[None, :], root[:, None] * (vt @ q2.T), sigma


def balance_pair(
    left: Float[Array, "p r"],
    right: Float[Array, "r q"],
    *,
    mode: BalanceMode = "procrustes",
    min_product_norm: Numeric = 0.0,
) -> tuple[Float[Array, "p r"], Float[Array, "r q"]]:
    """Project a factor pair onto the balanced manifold, keeping the product ``L R``.

    .. math::

        Q_1 T_1 = L,\\; Q_2 T_2 = R^\\top,\\; T_1 T_2^\\top = U \\Sigma V^\\top,\\;
        L' = Q_1 U \\Sigma^{1/2},\\; R' = \\Sigma^{1/2} V^\\top Q_2^\\top

    so ``L' R' = L R`` and ``L'ᵀL' = R'R'ᵀ = Σ`` (mode ``"svd"``, the paper's reference). Mode
    ``"procrustes"`` returns the balanced pair closest to ``(L, R)`` in Frobenius norm,
    ``(L' O, Oᵀ R')`` with ``O = polar(L'ᵀL + R'Rᵀ)``: it is idempotent and leaves an already
    balanced pair unchanged (so Adam's moments stay aligned). A pair whose product has Frobenius
    norm ``<= min_product_norm`` (e.g. the zero product at LoRA init) is returned unchanged, never
    collapsed to zero. Computed in float32 (at least) and cast back to the input dtype. Cost
    ``O((p + q) r² + r³)``; no ``p × q`` matrix is formed. Factors sharded on an explicit mesh
    are gathered first (they are thin, ``r`` columns); the result is replicated.

    Args:
        left: ``L`` ``[p, r]`` (``lora_a``).
        right: ``R`` ``[r, q]`` (``lora_b``).
        mode: ``"procrustes"`` (closest balanced pair, the default here) or ``"svd"``
            (SVD-aligned pair; idempotent only up to column signs).
        min_product_norm: pairs with ``‖L R‖_F`` at or below this are left untouched.

    Returns:
        The balanced ``(L', R')``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> left = jax.random.normal(jax.random.key(0), (6, 2))
        >>> right = jax.random.normal(jax.random.key(1), (2, 5))
        >>> l2, r2 = balance_pair(left, right)
        >>> bool(jnp.allclose(l2 @ r2, left @ right, atol=1e-5))
        True

    References:
        Castin et al, `Balanced LoRA <https://arxiv.org/abs/2605.31484>`_, 2026.
    """
    if left.ndim != 2 or right.ndim != 2 or left.shape[1] != right.shape[0]:
        raise ValueError(
            f"balance_pair: left {left.shape} and right {right.shape} must be [p, r] and [r, q] "
            "with the same r (lora_a [in, r], lora_b [r, out])."
        )
    if mode not in ("svd", "procrustes"):
        raise ValueError(f"balance_pair: mode={mode!r} is unknown; use 'svd' or 'procrustes'.")
    dtype = jnp.promote_types(left.dtype, jnp.float32)
    l32, r32 = _gathered(left).astype(dtype), _gathered(right).astype(dtype)
    new_l, new_r, sigma = _svd_balanced(l32, r32)
    if mode == "procrustes":
        rotation = polar(new_l.T @ l32 + new_r @ r32.T, drop_null=False)
        new_l, new_r = new_l @ rotation, rotation.T @ new_r
    product_norm = jnp.sqrt(jnp.sum(sigma**2))
    keep = product_norm <= min_product_norm
    new_l = jnp.where(keep, l32, new_l)
    new_r = jnp.where(keep, r32, new_r)
    return new_l.astype(left.dtype), new_r.astype(right.dtype)


def balancing_gap(left: Float[Array, "p r"], right: Float[Array, "r q"]) -> Float[Array, ""]:
    """``‖LᵀL − R Rᵀ‖_F``: zero exactly on the balanced manifold (for logging).

    Example::

        >>> import jax.numpy as jnp
        >>> float(balancing_gap(jnp.eye(3, 2), jnp.eye(2, 4)))
        0.0
    """
    left, right = left.astype(jnp.float32), right.astype(jnp.float32)
    return jnp.linalg.norm(left.T @ left - right @ right.T)


# ----------------------------------------------------------------------------- pairs


def relative_balancing_gap(tree: Any) -> float:
    """Mean over the LoRA pairs of ``tree`` of ``‖AᵀA − B Bᵀ‖_F / ‖A B‖_F`` (host-side).

    0 when every adapter is balanced; scale-free, so runs at different adapter scales compare.

    Example::

        >>> import jax.numpy as jnp
        >>> relative_balancing_gap({"q": {"lora_a": jnp.eye(3, 2), "lora_b": jnp.eye(2, 4)}})
        0.0
    """
    values, _, _ = flatten_by_path(tree)
    gaps = [float(balancing_gap(values[pa], values[pb])
                  / (jnp.linalg.norm(values[pa] @ values[pb]) + 1e-30))
            for pa, pb in find_pairs(tree, kinds=("lora",))]
    return float(np.mean(gaps))


def _balance_any(left, right, **kwargs):
    """:func:`balance_pair`, vmapped over the adapter axis of stacked multi-LoRA factors."""
    if left.ndim == 3 and right.ndim == 3:
        return jax.vmap(lambda l, r: balance_pair(l, r, **kwargs))(left, right)
    return balance_pair(left, right, **kwargs)


def balance_lora_params(params: Any, *, mode: BalanceMode = "procrustes",
                        min_product_norm: Numeric = 0.0) -> Any:
    """Apply :func:`balance_pair` to every ``(lora_a, lora_b)`` pair of a parameter tree.

    Use it right after ``optax.apply_updates`` in a loop you control (no rounding from the
    ``new − params`` subtraction that :func:`scale_by_balora` needs).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> p = {"lora_a": jax.random.normal(jax.random.key(0), (5, 2)),
        ...      "lora_b": jax.random.normal(jax.random.key(1), (2, 3))}
        >>> q = balance_lora_params(p)
        >>> bool(balancing_gap(q["lora_a"], q["lora_b"]) < 1e-4)
        True
    """
    values, order, treedef = flatten_by_path(params)
    for pa, pb in find_pairs(params, kinds=("lora",)):
        values[pa], values[pb] = _balance_any(values[pa], values[pb], mode=mode,
                                              min_product_norm=min_product_norm)
    return unflatten_by_path(treedef, order, values)


# ----------------------------------------------------------------------------- optax


def scale_by_balora(
    *,
    mode: BalanceMode = "procrustes",
    every: int = 1,
    start_step: int = 0,
    min_product_norm: Numeric = 0.0,
    pair_fn: PairFn | None = None,
) -> optax.GradientTransformation:
    """The BaLoRA projection as the last element of an optax chain.

    Given the base optimizer's ``updates`` and the current ``params``, each LoRA pair becomes
    ``(L', R') = balance(L + ΔL, R + ΔR)`` and the returned update is ``(L', R') − (L, R)``, so
    that ``optax.apply_updates`` lands exactly on the balanced pair; every other leaf passes
    through. Projection happens when ``count >= start_step`` and ``count % every == 0``. A pair
    whose post-step product is zero (LoRA init, ``B = 0``) is never projected: that would kill
    the adapter. Optimizer moments are not transformed.

    DERIVED: the default ``mode="procrustes"`` (the closest balanced pair) instead of the
    reference code's ``"svd"``; it leaves an already balanced pair untouched, so Adam's moments
    keep describing the same coordinates. ``mode="svd"`` reproduces the reference.

    .. warning:: It needs ``params`` and must come after the base optimizer (and after any
       learning-rate scaling) in the chain.

    Args:
        mode: ``"procrustes"`` or ``"svd"`` (see :func:`balance_pair`).
        every: project every ``every`` optimizer steps.
        start_step: first step (0-based count of updates) at which to project.
        min_product_norm: pairs with ``‖L R‖_F`` at or below this are left untouched.
        pair_fn: ``params -> [(a_path, b_path), ...]``, the contract of
            :mod:`lowrank_jax.optim.factors` (default ``find_pairs(params, kinds=("lora",))``).
            Stacked multi-LoRA factors (``[K, in, R]``, ``[K, R, out]``) are balanced adapter by
            adapter.

    Returns:
        A :class:`optax.GradientTransformation` with :class:`BaLoRAState`.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> params = {"lora_a": jax.random.normal(jax.random.key(0), (4, 2)),
        ...           "lora_b": jnp.ones((2, 3))}
        >>> tx = optax.chain(optax.adam(1e-2), scale_by_balora())
        >>> state = tx.init(params)
        >>> grads = jax.tree.map(jnp.ones_like, params)
        >>> updates, state = tx.update(grads, state, params)
        >>> new = optax.apply_updates(params, updates)
        >>> bool(balancing_gap(new["lora_a"], new["lora_b"]) < 1e-4)
        True

    References:
        Castin et al, `Balanced LoRA <https://arxiv.org/abs/2605.31484>`_, 2026.
    """
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"scale_by_balora: every={every!r} must be a positive int.")
    if not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"scale_by_balora: start_step={start_step!r} must be an int >= 0.")
    if mode not in ("svd", "procrustes"):
        raise ValueError(f"scale_by_balora: mode={mode!r} is unknown; use 'svd' or 'procrustes'.")

    def init_fn(params):
        del params
        return BaLoRAState(count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "scale_by_balora: params is None; call tx.update(grads, state, params) "
                "(nnx.Optimizer does this) because the projection needs the current factors."
            )
        up, order, treedef = flatten_by_path(updates)
        par, par_order, _ = flatten_by_path(params)
        if set(order) - set(par_order):
            missing = sorted(path_str(p) for p in set(order) - set(par_order))[:3]
            raise ValueError(
                f"scale_by_balora: updates have leaves {missing} that params lack; pass params "
                "with the same structure as the updates."
            )
        project = (state.count >= start_step) & (state.count % every == 0)
        out = dict(up)
        pairs = find_pairs(params, kinds=("lora",), pair_fn=pair_fn)
        if not pairs and has_unmasked_leaves(updates):
            raise ValueError(
                f"scale_by_balora: the tree has no LoRA factor pairs (leaves "
                f"{[path_str(p) for p in order][:3]}); balora balances lora_a / lora_b pairs: "
                "apply_lora first, or pass pair_fn=functools.partial(find_pairs, "
                "kinds=('factor',)) for (a, b) factors.")
        for pa, pb in pairs:
            if pa not in up or pb not in up:
                continue  # masked out of this partition
            left, right = par[pa], par[pb]
            step_l = left + up[pa].astype(left.dtype)
            step_r = right + up[pb].astype(right.dtype)
            bal_l, bal_r = _balance_any(jax.lax.stop_gradient(step_l),
                                        jax.lax.stop_gradient(step_r), mode=mode,
                                        min_product_norm=min_product_norm)
            out[pa] = jnp.where(project, bal_l - left, up[pa]).astype(up[pa].dtype)
            out[pb] = jnp.where(project, bal_r - right, up[pb]).astype(up[pb].dtype)
        count = optax.safe_int32_increment(state.count)
        return unflatten_by_path(treedef, order, out), BaLoRAState(count=count)

    return optax.GradientTransformation(init_fn, update_fn)


def balora(
    base_optimizer: optax.GradientTransformation,
    *,
    mode: BalanceMode = "procrustes",
    every: int = 1,
    start_step: int = 0,
    min_product_norm: Numeric = 0.0,
    pair_fn: PairFn | None = None,
) -> optax.GradientTransformation:
    """``optax.chain(base_optimizer, scale_by_balora(...))``: any optimizer, then the projection.

    The paper uses AdamW (weight decay 0.01) with a large adapter scale and a small learning
    rate; LoRA's hyperparameters do not transfer.

    Example::

        >>> import optax
        >>> tx = balora(optax.adamw(1e-4, weight_decay=0.01))

    References:
        Castin et al, `Balanced LoRA <https://arxiv.org/abs/2605.31484>`_, 2026.
    """
    return optax.chain(
        base_optimizer,
        scale_by_balora(mode=mode, every=every, start_step=start_step,
                        min_product_norm=min_product_norm, pair_fn=pair_fn),
    )


__all__ = ["BaLoRAState", "balance_lora_params", "balance_pair", "balancing_gap", "balora",
           "relative_balancing_gap", "scale_by_balora"]
