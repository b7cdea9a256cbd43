"""Transport Clustering: low-rank optimal transport by a full-rank registration plus clustering.

Low-rank OT restricts a coupling to ``P = Q diag(1/g) Rᵀ`` with ``Q ∈ Π(a, g)``, ``R ∈ Π(b, g)``,
``g ∈ Δ_K``. For any full-rank coupling ``P* ∈ Π(a, b)`` and any ``Q`` with ``Q1 = a``, the choice
``R = P*ᵀ diag(1/a) Q`` is feasible and

.. math:: ⟨C, Q\\,\\mathrm{diag}(1/g)\\,R^\\top⟩ = ⟨\\tilde C, Q\\,\\mathrm{diag}(1/g)\\,Q^\\top⟩,
   \\qquad \\tilde C = C\\,P^{*\\top} \\mathrm{diag}(1/a),

so LR-OT becomes one generalised K-means on the registered cost ``C̃`` (for a permutation σ:
``C̃_ij = c(x_i, y_σ(j))``). With an exact clustering oracle the cost is within ``(1+γ)·OPT_K``
(negative-type metrics) or ``(1+γ+√(2γ))·OPT_K`` (kernel costs such as squared Euclidean),
``γ = OPT_full / OPT_K``. The clustering here is mirror descent (a heuristic, restarted).

Example::

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (40, 2)) + jnp.repeat(jnp.eye(2) * 8, 20, 0)
    >>> plan = transport_clustering(jax.random.key(1), x=x, y=x + 0.5, rank=2, iterations=300)
    >>> plan.Q.shape, plan.R.shape
    ((40, 2), (40, 2))

References:
    Schmidt, Halmos, Raphael, `Transport Clustering: Solving Low-Rank Optimal Transport via
    Clustering <https://arxiv.org/abs/2603.03578>`_, ICML 2026.
    Scetbon, Cuturi, Peyré, `Low-Rank Sinkhorn Factorization <https://arxiv.org/abs/2103.04737>`_,
    ICML 2021.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from lowrank_jax.data.kmeans import kmeans


class LowRankPlan(NamedTuple):
    """``P = Q diag(1/g) Rᵀ`` (ott-jax's ``LRSinkhornOutput`` convention) and hard labels."""

    Q: Float[Array, "n K"]
    R: Float[Array, "m K"]
    g: Float[Array, " K"]
    cost: Float[Array, ""]
    labels_x: Int[Array, " n"]
    labels_y: Int[Array, " m"]


def _marginal(w, size, name):
    if w is None:
        return jnp.full((size,), 1.0 / size)
    w = jnp.asarray(w)
    if w.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {w.shape}.")
    return w


def _safe_inv(g):
    return jnp.where(g > 1e-12, 1.0 / jnp.maximum(g, 1e-12), 0.0)


def lr_cost(C: Float[Array, "n m"], Q, R, g) -> Float[Array, ""]:
    """``⟨C, Q diag(1/g) Rᵀ⟩`` (empty components, ``g_k = 0``, contribute 0)."""
    return jnp.sum((Q.T @ C) * R.T * _safe_inv(g)[:, None])


def lr_cost_factored(A: Float[Array, "n r"], B: Float[Array, "m r"], Q, R, g) -> Float[Array, ""]:
    """:func:`lr_cost` for ``C = A Bᵀ`` in ``O((n+m) K r)``, never forming ``C``."""
    return jnp.sum(jnp.sum((Q.T @ A) * (R.T @ B), axis=1) * _safe_inv(g))


def plan_matrix(Q, R, g) -> Float[Array, "n m"]:
    """The dense coupling ``Q diag(1/g) Rᵀ``."""
    return (Q * _safe_inv(g)[None]) @ R.T


def sqeuclidean_factors(x, y) -> tuple[Float[Array, "n r"], Float[Array, "m r"]]:
    """``‖x_i − y_j‖² = A_i·B_j`` with ``A = [‖x‖², 1, −2x]``, ``B = [1, ‖y‖², y]`` (r = d+2)."""
    A = jnp.concatenate([jnp.sum(x * x, 1, keepdims=True), jnp.ones((x.shape[0], 1)), -2 * x], 1)
    B = jnp.concatenate([jnp.ones((y.shape[0], 1)), jnp.sum(y * y, 1, keepdims=True), y], 1)
    return A, B


def point_cost(x, y, cost: str = "sqeuclidean") -> Float[Array, "n m"]:
    """Dense cost matrix: ``"sqeuclidean"`` or ``"euclidean"``."""
    d2 = jnp.maximum(jnp.sum(x * x, 1)[:, None] - 2 * x @ y.T + jnp.sum(y * y, 1)[None], 0.0)
    if cost == "sqeuclidean":
        return d2
    if cost == "euclidean":
        return jnp.sqrt(d2)
    raise ValueError(f"cost={cost!r} must be 'sqeuclidean' or 'euclidean'.")


def sinkhorn(C, a, b, *, epsilon_rel: float = 1e-3, iterations: int = 2000) -> Float[Array, "n m"]:
    """Log-domain entropic OT plan with ``ε = epsilon_rel · max|C|`` (fixed iteration count)."""
    eps = epsilon_rel * jnp.maximum(jnp.max(jnp.abs(C)), 1e-30)
    la, lb = jnp.log(a), jnp.log(b)

    def step(carry, _):
        f, h = carry
        f = eps * (la - jax.nn.logsumexp((h[None] - C) / eps, axis=1))
        h = eps * (lb - jax.nn.logsumexp((f[:, None] - C) / eps, axis=0))
        return (f, h), None

    (f, h), _ = jax.lax.scan(step, (jnp.zeros_like(a), jnp.zeros_like(b)), None,
                             length=iterations)
    return round_to_marginals(jnp.exp((f[:, None] + h[None] - C) / eps), a, b)


def round_to_marginals(P, a, b) -> Float[Array, "n m"]:
    """Project a nearly feasible plan onto ``Π(a, b)`` exactly (Altschuler, Weed, Rigollet 2017):
    shrink rows, then columns, to their marginals and add the rank-1 correction of the deficit."""
    P = P * jnp.minimum(a / jnp.maximum(P.sum(1), 1e-30), 1.0)[:, None]
    P = P * jnp.minimum(b / jnp.maximum(P.sum(0), 1e-30), 1.0)[None]
    err_a, err_b = jnp.maximum(a - P.sum(1), 0.0), jnp.maximum(b - P.sum(0), 0.0)
    return P + jnp.outer(err_a, err_b) / jnp.maximum(jnp.sum(err_a), 1e-30)


def _lp_plan(C, a, b):
    from scipy.optimize import linprog  # host reference for tests, not jit-able

    n, m = C.shape
    rows = np.kron(np.eye(n), np.ones((1, m)))
    cols = np.kron(np.ones((1, n)), np.eye(m))
    res = linprog(np.asarray(C, np.float64).ravel(), A_eq=np.vstack([rows, cols]),
                  b_eq=np.concatenate([np.asarray(a), np.asarray(b)]), bounds=(0, None),
                  method="highs")
    if not res.success:
        raise ValueError(f"full_rank_plan(method='lp'): the LP solver failed: {res.message}")
    return jnp.asarray(res.x.reshape(n, m), jnp.float32)


def full_rank_plan(C, a=None, b=None, *, method: str = "hungarian", epsilon_rel: float = 1e-3,
                   iterations: int = 2000):
    """The registration: an optimal full-rank plan.

    ``"hungarian"`` (uniform, ``n = m``): the exact permutation ``perm[n]`` with ``perm[i] = σ(i)``
    (optax's jit-able Hungarian algorithm); ``"sinkhorn"``: a near-unregularised soft plan
    ``P[n, m]``; ``"lp"``: the exact plan by SciPy's LP solver (host, small n, tests).
    """
    n, m = C.shape
    if method == "hungarian":
        if n != m or a is not None or b is not None:
            raise ValueError("full_rank_plan(method='hungarian') needs n == m and uniform "
                             f"marginals (got C {C.shape}, custom a/b); use method='sinkhorn'.")
        rows, cols = optax.assignment.hungarian_algorithm(C)
        return jnp.zeros((n,), jnp.int32).at[rows].set(cols.astype(jnp.int32))
    a, b = _marginal(a, n, "a"), _marginal(b, m, "b")
    if method == "sinkhorn":
        return sinkhorn(C, a, b, epsilon_rel=epsilon_rel, iterations=iterations)
    if method == "lp":
        return _lp_plan(C, a, b)
    raise ValueError(f"method={method!r} must be 'hungarian', 'sinkhorn' or 'lp'.")


def register_cost(C, P_or_perm, a=None) -> Float[Array, "n n"]:
    """``C̃ = C Pᵀ diag(1/a)``; for a permutation, ``C̃ = C[:, perm]``."""
    if P_or_perm.ndim == 1:
        return C[:, P_or_perm]
    a = _marginal(a, C.shape[0], "a")
    return (C @ P_or_perm.T) / a[None]


def register_factors(A, B, P_or_perm, a=None):
    """Factors of ``C̃``: ``(A, B_rot)`` with ``B_rot = diag(1/a) P B`` (``B[perm]`` for σ)."""
    if P_or_perm.ndim == 1:
        return A, B[P_or_perm]
    a = _marginal(a, A.shape[0], "a")
    return A, (P_or_perm @ B) / a[:, None]


def _mirror_descent(apply, apply_t, Q0, a, iterations, gamma0):
    """Exponentiated-gradient descent on ``f(Q) = Σ_k q_kᵀ C̃ q_k / g_k`` over
    ``{Q ≥ 0, Q1 = a}``."""
    log_a = jnp.log(a)

    def objective_and_grad(Q):
        g = jnp.maximum(Q.sum(0), 1e-12)
        CQ, CtQ = apply(Q), apply_t(Q)
        quad = jnp.sum(Q * CQ, 0)
        grad = (CQ + CtQ) / g[None] - (quad / g ** 2)[None]
        return jnp.sum(quad / g), grad

    def step(logQ, _):
        value, grad = objective_and_grad(jnp.exp(logQ))
        gamma = gamma0 / jnp.maximum(jnp.max(jnp.abs(grad)) ** 2, 1e-30)
        logQ = logQ - gamma * grad
        logQ = logQ - jax.nn.logsumexp(logQ, axis=1, keepdims=True) + log_a[:, None]
        return logQ, value

    logQ0 = jnp.log(jnp.maximum(Q0, 1e-30))
    logQ0 = logQ0 - jax.nn.logsumexp(logQ0, axis=1, keepdims=True) + log_a[:, None]
    logQ, losses = jax.lax.scan(step, logQ0, None, length=iterations)
    return jnp.exp(logQ), losses


def _init_q(key, init, n, rank, a):
    if isinstance(init, str):
        if init != "random":
            raise ValueError(f"init={init!r}: gkmeans takes 'random' or an initial Q [n, rank].")
        Q0 = jnp.abs(jax.random.normal(key, (n, rank))) + 1e-3
    else:
        Q0 = jnp.asarray(init)
        if Q0.shape != (n, rank):
            raise ValueError(f"init has shape {Q0.shape}; an initial Q must be [n, rank] = "
                             f"[{n}, {rank}].")
    return Q0 / Q0.sum(1, keepdims=True) * a[:, None]


def _check_rank(rank, n):
    if not isinstance(rank, int) or not 1 <= rank <= n:
        raise ValueError(f"rank={rank!r} must be an int in [1, n={n}].")


def gkmeans(key, C_reg, a=None, rank: int = 2, *, init="random", iterations: int = 2500,
            gamma0: float = 2.0, normalize_cost: bool = True):
    """Generalised K-means on a square cost: ``min_{Q ≥ 0, Q1 = a} Σ_k q_kᵀ C̃ q_k / g_k``.

    Mirror descent in the log domain, ``γ_t = γ0 / max|∇f|²``; ``normalize_cost`` divides ``C̃``
    by ``max|C̃|`` first (the step rule is not scale invariant). Returns ``(Q, objective per
    iteration)`` (objective on the normalised cost). Jit-able with static ``rank, iterations``.
    """
    n = C_reg.shape[0]
    if C_reg.shape != (n, n):
        raise ValueError(f"C_reg must be square [n, n], got {C_reg.shape}; register it first.")
    _check_rank(rank, n)
    a = _marginal(a, n, "a")
    if normalize_cost:
        C_reg = C_reg / jnp.maximum(jnp.max(jnp.abs(C_reg)), 1e-30)
    Q0 = _init_q(key, init, n, rank, a)
    return _mirror_descent(lambda Q: C_reg @ Q, lambda Q: C_reg.T @ Q, Q0, a, iterations, gamma0)


def factored_max_abs(A, B, *, block_rows: int = 1024) -> Float[Array, ""]:
    """``max|A Bᵀ|`` computed in row blocks (memory ``O(block · m)``)."""
    n = A.shape[0]
    pad = (-n) % block_rows
    blocks = jnp.pad(A, ((0, pad), (0, 0))).reshape(-1, block_rows, A.shape[1])
    return jnp.max(jax.lax.map(lambda blk: jnp.max(jnp.abs(blk @ B.T)), blocks))


def gkmeans_factored(key, A, B_rot, a=None, rank: int = 2, *, init="random",
                     iterations: int = 2500, gamma0: float = 2.0, normalize_cost: bool = True):
    """:func:`gkmeans` for ``C̃ = A B_rotᵀ``: ``O(n K r)`` per step, never forms ``n × n``."""
    n = A.shape[0]
    if B_rot.shape[0] != n or A.shape[1] != B_rot.shape[1]:
        raise ValueError(f"A {A.shape} and B_rot {B_rot.shape} must both be [n, r].")
    _check_rank(rank, n)
    a = _marginal(a, n, "a")
    if normalize_cost:
        A = A / jnp.maximum(factored_max_abs(A, B_rot), 1e-30)
    Q0 = _init_q(key, init, n, rank, a)
    return _mirror_descent(lambda Q: A @ (B_rot.T @ Q), lambda Q: B_rot @ (A.T @ Q), Q0, a,
                           iterations, gamma0)


def _harden(Q, a):
    labels = jnp.argmax(Q, axis=1)
    return jax.nn.one_hot(labels, Q.shape[1], dtype=Q.dtype) * a[:, None], labels


def transport_clustering(
    key: jax.Array,
    C: Float[Array, "n m"] | None = None,
    *,
    x=None,
    y=None,
    cost: str = "sqeuclidean",
    rank: int,
    a=None,
    b=None,
    registration: str = "hungarian",
    both_sides: bool = True,
    init: str = "kmeans_mid",
    restarts: int = 5,
    round_hard: bool = True,
    iterations: int = 2500,
    gamma0: float = 2.0,
    factored: bool = False,
    epsilon_rel: float = 1e-3,
    sinkhorn_iterations: int = 2000,
) -> LowRankPlan:
    """Low-rank OT by transport registration + generalised K-means (both sides, restarts).

    Give a cost ``C`` or point clouds ``x, y`` (``cost``). ``registration``: ``"hungarian"``,
    ``"sinkhorn"``, ``"lp"`` (see :func:`full_rank_plan`) or a precomputed ``perm[n]`` / ``P[n, m]``
    (e.g. from any large-scale OT solver). ``factored=True`` (squared-Euclidean points) runs the
    clustering on ``C̃ = A B_rotᵀ`` (``B_rot = B[σ]`` or ``diag(1/a) P B``) in ``O(n K r)`` per
    step; no ``n × n`` cost is formed except for a Hungarian/Sinkhorn registration itself.
    ``init="kmeans_mid"``: K-means on the registered midpoints ``(x_i + ȳ_i)/2`` (``ȳ = y[σ]`` or
    the barycentric ``diag(1/a) P y``) mixed 50/50 with random rows (``"random"`` for a cost).
    The best of ``restarts × sides`` by true transport cost is returned.
    """
    if C is None:
        if x is None or y is None:
            raise ValueError("transport_clustering needs a cost C or both point clouds x and y.")
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    given = not isinstance(registration, str)
    if factored and (x is None or cost != "sqeuclidean"):
        raise ValueError("factored=True needs point clouds x, y with cost='sqeuclidean'.")
    if not isinstance(restarts, int) or restarts < 1:
        raise ValueError(f"restarts={restarts!r} must be a positive int.")
    if init not in ("kmeans_mid", "random"):
        raise ValueError(f"init={init!r} must be 'kmeans_mid' or 'random'.")
    if C is None and not factored:
        C = point_cost(x, y, cost)
    n = x.shape[0] if C is None else C.shape[0]
    m = y.shape[0] if C is None else C.shape[1]
    _check_rank(rank, min(n, m))
    a_, b_ = _marginal(a, n, "a"), _marginal(b, m, "b")
    if given:
        P = jnp.asarray(registration)
        if P.shape not in ((n,), (n, m)):
            raise ValueError(f"registration array has shape {P.shape}; give perm[{n}] or "
                             f"P[{n}, {m}].")
    elif factored:
        P = full_rank_plan(point_cost(x, y, cost), a, b, method=registration,
                           epsilon_rel=epsilon_rel, iterations=sinkhorn_iterations)
    else:
        P = full_rank_plan(C, a, b, method=registration, epsilon_rel=epsilon_rel,
                           iterations=sinkhorn_iterations)
    perm = P.ndim == 1
    keys = jax.random.split(key, 2 * restarts)

    def init_rows(k, size, ac, points=None):
        k_mix, k_km = jax.random.split(k)
        rand = jnp.abs(jax.random.normal(k_mix, (size, rank))) + 1e-3
        rand = rand / rand.sum(1, keepdims=True)
        if init == "random" or points is None:
            return rand * ac[:, None]
        _, labels = kmeans(k_km, points, rank)
        hard = jax.nn.one_hot(labels, rank)
        return (0.5 * hard + 0.5 * rand) * ac[:, None]

    def solve_side(side_keys, side):
        # side "x": cluster Q on C̃ = C Pᵀ diag(1/a); side "y": the same on the transposed problem.
        inv = jnp.argsort(P) if perm else None
        Pt = inv if perm else P.T
        if side == "x":
            ac, size = a_, n
            mid = None if x is None else (x + register_factors(x, y, P, a_)[1]) / 2
        else:
            ac, size = b_, m
            mid = None if x is None else (y + register_factors(y, x, Pt, b_)[1]) / 2
        if factored:
            A, B = sqeuclidean_factors(x, y)
            fa, fb = ((A, register_factors(A, B, P, a_)[1]) if side == "x"
                      else (B, register_factors(B, A, Pt, b_)[1]))
            cluster = lambda k, Q0: gkmeans_factored(k, fa, fb, ac, rank, init=Q0,
                                                     iterations=iterations, gamma0=gamma0)[0]
        else:
            Ct, Pt = (C, P) if side == "x" else (C.T, Pt)
            C_reg = register_cost(Ct, Pt, ac)
            cluster = lambda k, Q0: gkmeans(k, C_reg, ac, rank, init=Q0, iterations=iterations,
                                            gamma0=gamma0)[0]

        def one(k):
            Qs = cluster(k, init_rows(k, size, ac, mid))
            return _harden(Qs, ac)[0] if round_hard else Qs

        return jax.vmap(one)(side_keys)

    def partner(Qs, side):
        # R = Pᵀ diag(1/a) Q (x side) or Q = P diag(1/b) R (y side)
        if side == "x":
            return Qs[jnp.argsort(P)] if perm else P.T @ (Qs / a_[:, None])
        return Qs[P] if perm else P @ (Qs / b_[:, None])

    Qs_all, Rs_all = [], []
    for i, side in enumerate(("x", "y") if both_sides else ("x",)):
        Qs = solve_side(keys[i * restarts:(i + 1) * restarts], side)
        partners = jax.vmap(lambda q, side=side: partner(q, side))(Qs)
        Qs_all.append(Qs if side == "x" else partners)
        Rs_all.append(partners if side == "x" else Qs)
    Qs_all, Rs_all = jnp.concatenate(Qs_all), jnp.concatenate(Rs_all)
    if factored:
        A, B = sqeuclidean_factors(x, y)
        true_cost = lambda Q, R: lr_cost_factored(A, B, Q, R, Q.sum(0))
    else:
        true_cost = lambda Q, R: lr_cost(C, Q, R, Q.sum(0))
    costs = jax.vmap(true_cost)(Qs_all, Rs_all)
    best = jnp.argmin(costs)
    Q, R = Qs_all[best], Rs_all[best]
    return LowRankPlan(Q, R, Q.sum(0), costs[best], jnp.argmax(Q, 1), jnp.argmax(R, 1))


__all__ = [
    "LowRankPlan", "factored_max_abs", "full_rank_plan", "gkmeans", "gkmeans_factored",
    "lr_cost", "lr_cost_factored", "plan_matrix", "point_cost", "register_cost",
    "register_factors", "round_to_marginals", "sinkhorn", "sqeuclidean_factors",
    "transport_clustering",
]
