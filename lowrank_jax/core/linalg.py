"""Shared dense linear algebra for the optimizers: Newton–Schulz, polar, power iteration, SVD.

Everything here is a pure ``jnp`` function that works inside ``jax.jit`` and on sharded inputs.

**Sharding decision.** A thin factor ``a`` of shape ``[m, r]`` (``m ≫ r``) is sharded along its
long axis ``m`` (FSDP). Newton–Schulz works in the wide orientation ``X = aᵀ`` of shape
``[r, m]``; its only contraction over the long axis is the small Gram matrix ``S = X·Xᵀ``
(``r×r``), which XLA lowers to a local matmul plus an all-reduce. The polynomial step
``X ← a₁X + (b₁S + c₁S²)X`` multiplies a replicated ``r×r`` matrix into the sharded ``X`` and
keeps the long-axis sharding, so the whole factor is never gathered. Power iteration likewise
contracts over the long axis only to produce an ``r``-vector. Under an ``Explicit`` mesh JAX
refuses to guess the sharding of a contraction over a sharded axis ("Contracting dimensions are
sharded and it is ambiguous ..."), so every such contraction here passes
``out_sharding=NamedSharding(<the input's mesh>, P())`` — a replicated small result — which is
exactly the all-reduce described above. Under ``Auto`` meshes or no mesh the argument is omitted
and XLA's propagation makes the same choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import _muon as _optax_muon  # Newton–Schulz is not re-exported by optax
from jaxtyping import Array, Float

from lowrank_jax.core.sharding import gathered, with_sharding_of

MUON_COEFFS = (3.4445, -4.7750, 2.0315)

#: a numeric hyperparameter: a Python number, or the array ``optax.inject_hyperparams`` passes
Numeric = float | jax.Array

CoeffSpec = tuple[float, float, float] | Sequence[tuple[float, float, float]] | Literal["exact"]


def _replicated_out(*operands, ndim: int):
    """``NamedSharding(mesh, P())`` when an operand is sharded on an Explicit mesh, else None."""
    for x in operands:
        sharding = getattr(jax.typeof(x), "sharding", None)
        if sharding is None or not isinstance(sharding, NamedSharding):
            continue
        mesh = sharding.mesh
        if any(s is not None for s in sharding.spec) and any(
            t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())
        ):
            return NamedSharding(mesh, PartitionSpec(*([None] * ndim)))
    return None


def _contract(lhs, rhs, lhs_axis: int, rhs_axis: int):
    """``dot_general`` over one axis whose (possibly sharded) result is replicated."""
    out_ndim = lhs.ndim + rhs.ndim - 2
    dims = (((lhs_axis,), (rhs_axis,)), ((), ()))
    out = _replicated_out(lhs, rhs, ndim=out_ndim)
    if out is None:
        return jax.lax.dot_general(lhs, rhs, dims)
    return jax.lax.dot_general(lhs, rhs, dims, out_sharding=out)


def _check_matrix(x, name: str, min_ndim: int = 2):
    if x.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dims ([..., rows, cols]), got shape {x.shape}; "
            "reshape it to a matrix first."
        )


def _normalize_coeffs(coeffs) -> tuple[tuple[float, float, float], ...] | str:
    if isinstance(coeffs, str):
        if coeffs != "exact":
            raise ValueError(f"coeffs={coeffs!r} is unknown; use 'exact' or (a, b, c) triples.")
        return coeffs
    arr = np.asarray(coeffs, dtype=np.float64)
    if arr.shape == (3,):
        return (tuple(float(c) for c in arr),)
    if arr.ndim == 2 and arr.shape[1] == 3 and arr.shape[0] >= 1:
        return tuple(tuple(float(c) for c in row) for row in arr)
    raise ValueError(
        f"coeffs must be one (a, b, c) triple, a sequence of triples or 'exact'; got shape "
        f"{arr.shape}. Example: coeffs=(3.4445, -4.7750, 2.0315)."
    )


def polar(
    x: Float[Array, "*batch m n"], *, eps: Numeric = 1e-7, drop_null: bool = True
) -> Float[Array, "*batch m n"]:
    """Exact polar factor ``U Vᵀ`` of ``x = U Σ Vᵀ`` (via SVD), zero on the null space.

    .. math:: \\operatorname{polar}(X) = \\sum_{i:\\,\\sigma_i > \\tau} u_i v_i^\\top,
       \\quad \\tau = \\epsilon_{\\text{rel}}\\,\\sigma_1

    Directions with a singular value below ``τ = max(eps, 10·dtype_eps·max(m, n))·σ₁`` are
    dropped (DERIVED), so ``polar(0) = 0`` like Newton–Schulz rather than an arbitrary basis.
    With ``drop_null=False`` every direction is kept: the result of a square input is then always
    orthogonal (what a Procrustes rotation needs, e.g. BaLoRA's). Computed in at least fp32.

    Args:
        x: ``[..., m, n]`` matrices.
        eps: relative cut-off for null directions.
        drop_null: zero the directions below the cut-off (default) or keep them all.

    Returns:
        The polar factor, same shape and dtype as ``x``.

    Example::

        >>> import jax.numpy as jnp
        >>> polar(jnp.diag(jnp.array([3.0, 0.5]))).tolist()
        [[1.0, 0.0], [0.0, 1.0]]
        >>> polar(jnp.diag(jnp.array([3.0, 0.0]))).tolist()
        [[1.0, 0.0], [0.0, 0.0]]
    """
    _check_matrix(x, "polar: x")
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    u, s, vt = jnp.linalg.svd(x.astype(dtype), full_matrices=False)
    if not drop_null:
        return (u @ vt).astype(x.dtype)
    rel = jnp.maximum(eps, 10 * float(jnp.finfo(dtype).eps) * max(x.shape[-2:]))
    keep = (s > rel * s[..., :1]).astype(dtype)
    return ((u * keep[..., None, :]) @ vt).astype(x.dtype)


def _ns_2d_sharded(x, coeffs, steps: int, eps: Numeric):
    """Our loop for a factor sharded on an Explicit mesh: the Gram's sharding is requested."""
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T  # wide orientation: [r, m] with r <= m, Gram matrix is r×r
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x))) + eps)
    for i in range(steps):
        a, b, c = coeffs[i % len(coeffs)]
        gram = _contract(x, x, 1, 1)  # X Xᵀ: contraction over the long (maybe sharded) axis
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T if transposed else x


def _ns_2d(x, coeffs, steps: int, eps: Numeric):
    """optax's Newton–Schulz (``optax.contrib``'s Muon), unless the input is Explicit-sharded."""
    if _replicated_out(x, ndim=2) is not None:
        return _ns_2d_sharded(x, coeffs, steps, eps)
    if len(coeffs) == 1 or steps == 0:
        table = jnp.asarray(coeffs[0], x.dtype)
    else:  # optax runs one row per step: unroll our cycled table to `steps` rows
        table = jnp.asarray([coeffs[i % len(coeffs)] for i in range(steps)], x.dtype)
    return _optax_muon.orthogonalize_via_newton_schulz(x, table, steps, eps=eps)


def newton_schulz(
    x: Float[Array, "*batch m n"],
    *,
    steps: int = 5,
    coeffs: CoeffSpec = MUON_COEFFS,
    eps: Numeric = 1e-7,
) -> Float[Array, "*batch m n"]:
    """Approximate orthogonalization ``NS(X) ≈ polar(X)`` by a quintic Newton–Schulz iteration.

    .. math::
        X_0 = X / (\\lVert X \\rVert_F + \\epsilon), \\qquad
        S_k = X_k X_k^\\top, \\qquad
        X_{k+1} = a X_k + (b S_k + c S_k^2) X_k

    run in the wide orientation (a tall input is transposed first, so ``S`` is the small
    ``min(m,n)²`` Gram matrix) and transposed back. This *is* optax's iteration
    (``optax.contrib``'s Muon ``orthogonalize_via_newton_schulz``, wrapped here once); only a
    matrix sharded on an ``Explicit`` mesh takes our own loop, which requests the replicated
    sharding of the Gram matrix (optax's would fail on the ambiguous contraction). With Muon's
    coefficients ``(3.4445, −4.7750, 2.0315)`` and 5 steps the singular values land in about
    ``[0.68, 1.13]``, not exactly 1. ``NS(0) = 0`` exactly (no NaN) thanks to ``eps``.

    Sharding: see the module docstring — the only long-axis contraction is the Gram matrix,
    whose replicated result is requested explicitly on Explicit meshes.

    Args:
        x: ``[..., m, n]``; leading batch axes are vmapped over.
        steps: number of iterations.
        coeffs: one ``(a, b, c)`` triple, a sequence of triples (step ``i`` uses
            ``coeffs[i % len(coeffs)]``, as NVIDIA's cycled "quintic" sets), or ``"exact"`` for
            the SVD polar factor (:func:`polar`).
        eps: added to the Frobenius norm before dividing.

    Returns:
        Same shape and dtype as ``x``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> o = newton_schulz(jax.random.normal(jax.random.key(0), (64, 16)))
        >>> s = jnp.linalg.svd(o, compute_uv=False)
        >>> bool((s > 0.6).all() & (s < 1.2).all())
        True

    References:
        Jordan et al, `Muon: An optimizer for hidden layers
        <https://kellerjordan.github.io/posts/muon/>`_, 2024;
        Janson et al, `Stabilizing Native Low-Rank LLM Pretraining
        <https://arxiv.org/abs/2602.12429>`_, 2026.
    """
    _check_matrix(x, "newton_schulz: x")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"newton_schulz: steps must be a non-negative int, got {steps!r}.")
    table = _normalize_coeffs(coeffs)
    if table == "exact":
        return polar(x, eps=eps)
    fn = lambda m: _ns_2d(m, table, steps, eps)  # noqa: E731
    for _ in range(x.ndim - 2):
        fn = jax.vmap(fn)
    return fn(x)


def _unit(x, eps: Numeric = 1e-30):
    norm = jnp.sqrt(jnp.sum(jnp.square(x)))
    return x / jnp.maximum(norm, eps), norm


def power_iteration(
    matrix: Float[Array, "m k"],
    v: Float[Array, " k"],
    *,
    iters: int = 1,
) -> tuple[Float[Array, ""], Float[Array, " k"]]:
    """Warm-started power iteration for the top singular value, with a Rayleigh estimate.

    .. math::
        v \\leftarrow v/\\lVert v\\rVert;\\quad \\text{repeat } k:\\;
        u = \\tfrac{Mv}{\\lVert Mv\\rVert},\\; v = \\tfrac{M^\\top u}{\\lVert M^\\top u\\rVert};
        \\qquad \\hat\\sigma = u^\\top M v \\le \\sigma_{\\max}

    ``σ̂`` is a Rayleigh quotient of unit vectors, so it never exceeds ``σ_max``. If ``M v``
    vanishes (e.g. ``M = 0``) the returned ``σ̂`` is 0 and the old ``v`` is kept, so the next
    call does not start from a zero vector (DERIVED). Store the returned ``v`` and pass it back
    next step: one iteration per step then converges across steps (Spectron, Algorithm 3).

    Args:
        matrix: ``[m, k]``; for a ``[r, n]`` factor pass its transpose so ``v`` stays size r.
        v: ``[k]`` warm start (any non-zero vector the first time).
        iters: iterations per call.

    Returns:
        ``(sigma, v)``: the estimate (fp32 scalar) and the new right vector (fp32, unit norm).

    Example::

        >>> import jax.numpy as jnp
        >>> sigma, v = power_iteration(jnp.diag(jnp.array([2.0, 1.0])), jnp.ones(2), iters=30)
        >>> round(float(sigma), 4)
        2.0
    """
    if matrix.ndim != 2 or v.shape != (matrix.shape[1],):
        raise ValueError(
            f"power_iteration: matrix must be [m, k] and v [k]; got {matrix.shape} and {v.shape}."
        )
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"power_iteration: iters must be a positive int, got {iters!r}.")
    m = matrix.astype(jnp.float32)
    v_old, _ = _unit(v.astype(jnp.float32))
    vk = v_old
    u = jnp.zeros((m.shape[0],), jnp.float32)
    for _ in range(iters):
        u, _ = _unit(m @ vk)
        vk, _ = _unit(_contract(m, u, 0, 0))
    sigma = _contract(u, m @ vk, 0, 0)
    alive = jnp.sum(jnp.square(vk)) > 0.5
    return jnp.where(alive, sigma, 0.0), jnp.where(alive, vk, v_old)


def spectral_norm_exact(matrix: Float[Array, "m n"]) -> Float[Array, ""]:
    """Exact ‖M‖₂ as the root of the top eigenvalue of the small Gram matrix (``eigvalsh``).

    .. math:: \\lVert M\\rVert_2 = \\sqrt{\\lambda_{\\max}(G)},\\;
       G = M^\\top M \\text{ if } m \\ge n \\text{ else } M M^\\top

    Args:
        matrix: ``[m, n]``.

    Returns:
        fp32 scalar.

    Example::

        >>> import jax.numpy as jnp
        >>> round(float(spectral_norm_exact(jnp.array([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))), 4)
        3.0
    """
    if matrix.ndim != 2:
        raise ValueError(f"spectral_norm_exact: matrix must be 2-D, got shape {matrix.shape}.")
    m = matrix.astype(jnp.float32)
    gram = _contract(m, m, 0, 0) if m.shape[0] >= m.shape[1] else _contract(m, m, 1, 1)
    return jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(gram)[-1], 0.0))


def randomized_svd(
    matrix: Float[Array, "m n"],
    rank: int,
    *,
    oversample: int = 10,
    power_iters: int = 2,
    key: jax.Array | None = None,
) -> tuple[Float[Array, "m rank"], Float[Array, " rank"], Float[Array, "rank n"]]:
    """Truncated SVD by a Gaussian range finder with subspace (power) iterations.

    .. math:: Y = (MM^\\top)^{q} M \\Omega,\\; Q = \\operatorname{qr}(Y),\\;
       Q^\\top M = \\tilde U \\Sigma V^\\top,\\; U = Q\\tilde U

    Args:
        matrix: ``[m, n]``.
        rank: number of singular triplets, ``1 <= rank <= min(m, n)``.
        oversample: extra sketch columns.
        power_iters: ``q``, re-orthonormalized each time.
        key: PRNG key (default ``jax.random.key(0)``).

    Returns:
        ``(u [m, rank], s [rank], vt [rank, n])``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> m = jax.random.normal(jax.random.key(1), (40, 30))
        >>> u, s, vt = randomized_svd(m, 5)
        >>> bool(jnp.allclose(s, jnp.linalg.svd(m, compute_uv=False)[:5], rtol=1e-2))
        True

    References:
        Halko, Martinsson, Tropp, `Finding structure with randomness
        <https://arxiv.org/abs/0909.4061>`_, 2011.
    """
    if matrix.ndim != 2:
        raise ValueError(f"randomized_svd: matrix must be 2-D, got shape {matrix.shape}.")
    m_rows, n_cols = matrix.shape
    if not isinstance(rank, int) or not 1 <= rank <= min(m_rows, n_cols):
        raise ValueError(
            f"randomized_svd: rank={rank!r} must be an int in [1, {min(m_rows, n_cols)}]."
        )
    if oversample < 0 or power_iters < 0:
        raise ValueError(
            f"randomized_svd: oversample={oversample} and power_iters={power_iters} must be >= 0."
        )
    key = jax.random.key(0) if key is None else key
    width = min(rank + oversample, min(m_rows, n_cols))
    mat = matrix.astype(jnp.float32)
    omega = jax.random.normal(key, (n_cols, width), jnp.float32)
    q, _ = jnp.linalg.qr(mat @ omega)
    for _ in range(power_iters):
        z, _ = jnp.linalg.qr(mat.T @ q)
        q, _ = jnp.linalg.qr(mat @ z)
    u_small, s, vt = jnp.linalg.svd(q.T @ mat, full_matrices=False)
    return (q @ u_small)[:, :rank], s[:rank], vt[:rank]


__all__ = [
    "MUON_COEFFS",
    "Numeric",
    "gathered",
    "newton_schulz",
    "polar",
    "power_iteration",
    "randomized_svd",
    "spectral_norm_exact",
    "with_sharding_of",
]
