"""Update-subspace probes and the curvature harm signal of the lock-in spec (all DERIVED).

The target paper (narrow fine-tuning "lock-in", ICML 2026) was not found; every definition here is
our reconstruction (see the lockin_probes spec) and is kept behind arguments so that it can be
swapped for the paper's. Layout: a Dense kernel is ``[d_in, d_out]``; ``ΔW_t = W_t − W_0``.

Curvature is an *input*: per layer a pair ``(A [d_in, d_in], G [d_out, d_out])`` of Kronecker
factors computed once at ``W_0`` on broad data — e.g. from
``lowrank_jax.curvature.kfac.estimate_kfac_factors`` (objects with ``.A`` and ``.G`` are accepted)
or from the simple local estimate :func:`local_kfac` on one batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float

from lowrank_jax.core.svd import svd_exact
from lowrank_jax.core.linalg import randomized_svd
from lowrank_jax.core.rank import effective_rank, stable_rank
from lowrank_jax.analysis.spectra import principal_angles


class CurvatureBasis(NamedTuple):
    """Eigenbases of the two Kronecker factors and the sharp/soft split of their products."""

    u_a: Array  # [d_in, d_in]
    lam_a: Array  # [d_in]
    u_g: Array  # [d_out, d_out]
    lam_g: Array  # [d_out]
    soft: Array  # [d_in, d_out] bool: λ_A,i λ_G,j < τ
    tau: Array  # shape=(): threshold on products


def _factors(curvature):
    if hasattr(curvature, "A") and hasattr(curvature, "G"):
        return curvature.A, curvature.G
    a, g = curvature
    return a, g


def local_kfac(
    inputs: Float[Array, "n d_in"], output_grads: Float[Array, "n d_out"]
) -> tuple[Float[Array, "d_in d_in"], Float[Array, "d_out d_out"]]:
    """Simple K-FAC factors ``A = XᵀX/n``, ``G = GᵀG/n`` of one Dense layer from one batch.

    A local stand-in for ``lowrank_jax.curvature.kfac``; for the GNH/true Fisher the output
    gradients must be taken w.r.t. *sampled* labels (spec §7).

    Example::

        >>> import jax.numpy as jnp
        >>> a, g = local_kfac(jnp.ones((4, 2)), jnp.ones((4, 3)))
        >>> a.shape, g.shape
        ((2, 2), (3, 3))
    """
    n = inputs.shape[0]
    if output_grads.shape[0] != n:
        raise ValueError(
            f"inputs {inputs.shape} and output_grads {output_grads.shape} need the same n."
        )
    return inputs.T @ inputs / n, output_grads.T @ output_grads / n


def curvature_basis(curvature, *, energy: float = 0.9) -> CurvatureBasis:
    """Eigendecompose ``(A, G)`` and split the Kronecker products at energy ``γ`` (CrispEdit §3.3).

    The sharp set is the smallest set of largest products ``λ_A,i λ_G,j`` holding a fraction
    ``energy`` of their sum; ``τ`` is the smallest sharp product and ``soft = (λλᵀ < τ)``.

    Example::

        >>> import jax.numpy as jnp
        >>> b = curvature_basis((jnp.diag(jnp.array([10.0, 1.0])), jnp.eye(1)), energy=0.9)
        >>> int(b.soft.sum()), float(b.tau)  # eigen order is ascending: soft = the λ=1 mode
        (1, 10.0)
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy={energy} must lie in (0, 1].")
    a, g = _factors(curvature)
    lam_a, u_a = jnp.linalg.eigh(0.5 * (a + a.T))
    lam_g, u_g = jnp.linalg.eigh(0.5 * (g + g.T))
    lam_a, lam_g = jnp.maximum(lam_a, 0.0), jnp.maximum(lam_g, 0.0)
    prod = lam_a[:, None] * lam_g[None, :]
    flat = jnp.sort(prod.ravel())[::-1]
    cum = jnp.cumsum(flat) / jnp.maximum(jnp.sum(flat), 1e-30)
    count = jnp.minimum(jnp.sum(cum < energy * (1 - 1e-9)) + 1, flat.shape[0])
    tau = flat[count - 1]
    return CurvatureBasis(u_a, lam_a, u_g, lam_g, prod < tau, tau)


def project_soft(x: Float[Array, "d_in d_out"], basis: CurvatureBasis) -> Array:
    """``P_soft(X) = U_A[(U_AᵀXU_G) ⊙ M]U_Gᵀ`` with ``M = soft`` mask."""
    coeff = basis.u_a.T @ x @ basis.u_g
    return basis.u_a @ jnp.where(basis.soft, coeff, 0.0) @ basis.u_g.T


def project_sharp(x: Float[Array, "d_in d_out"], basis: CurvatureBasis) -> Array:
    """``P_sharp = I − P_soft``."""
    return x - project_soft(x, basis)


def sharp_fraction(delta: Float[Array, "d_in d_out"], basis: CurvatureBasis) -> dict:
    """Channelling: sharp fraction ``φ = ‖P_sharp δ‖²/‖δ‖²``, isotropic ``φ_iso``, ``χ = φ/φ_iso``.

    Example::

        >>> import jax.numpy as jnp
        >>> b = curvature_basis((jnp.diag(jnp.array([10.0, 1.0])), jnp.eye(1)))
        >>> sharp_fraction(jnp.array([[1.0], [0.0]]), b)["phi"]
        1.0
    """
    total = jnp.sum(jnp.square(delta))
    sharp = jnp.sum(jnp.square(project_sharp(delta, basis)))
    phi = float(sharp / jnp.maximum(total, 1e-30))
    n_sharp = int(jnp.sum(~basis.soft))
    phi_iso = n_sharp / basis.soft.size
    return {"phi": phi, "phi_iso": phi_iso, "channelling": phi / max(phi_iso, 1e-30)}


def rayleigh_quotient(delta: Float[Array, "d_in d_out"], curvature) -> Float[Array, ""]:
    """``r = tr(A δ G δᵀ) / (λ_A,max λ_G,max ‖δ‖²) ∈ [0, 1]``."""
    a, g = _factors(curvature)
    num = jnp.trace(a @ delta @ g @ delta.T)
    lam = jnp.linalg.eigvalsh(a)[-1] * jnp.linalg.eigvalsh(g)[-1]
    return num / jnp.maximum(lam * jnp.sum(jnp.square(delta)), 1e-30)


def harm_signal(deltas: dict, curvatures: dict) -> dict:
    """Objective-agnostic harm: ``h = ½ Σ_l tr(A_l ΔW_l G_l ΔW_lᵀ) ≈ E_broad KL(p_{W0} ‖ p_{W})``.

    The Bregman/Gauss–Newton quadratic at ``W_0`` (first-order term zero for the KL). Needs no
    labels and no forward pass.

    Args:
      deltas: ``{layer: ΔW [d_in, d_out]}``.
      curvatures: ``{layer: (A, G)}`` (or K-FAC factor objects) computed at ``W_0`` on broad data.

    Returns:
      ``{"total": h, "per_layer": {layer: h_l}}``.

    Example::

        >>> import jax.numpy as jnp
        >>> harm_signal({"w": jnp.ones((2, 1))}, {"w": (jnp.eye(2), jnp.eye(1))})["total"]
        1.0
    """
    per = {}
    for name, delta in deltas.items():
        if name not in curvatures:
            raise ValueError(
                f"no curvature for layer {name!r}; pass curvatures[{name!r}] = (A, G)."
            )
        a, g = _factors(curvatures[name])
        if a.shape[0] != delta.shape[0] or g.shape[0] != delta.shape[1]:
            raise ValueError(
                f"layer {name!r}: ΔW {delta.shape} needs A [{delta.shape[0]}]² and "
                f"G [{delta.shape[1]}]², got A {a.shape}, G {g.shape}."
            )
        per[name] = float(0.5 * jnp.trace(a @ delta @ g @ delta.T))
    return {"total": float(sum(per.values())), "per_layer": per}


def top_subspaces(delta: Float[Array, "m n"], k: int, *, key=None):
    """Orthonormal top-k left/right singular bases and singular values of an update."""
    kk = min(k, *delta.shape)
    if key is not None and kk < min(delta.shape):
        u, s, vt = randomized_svd(delta, int(kk), key=key)
    else:
        u, s, vt = svd_exact(delta)
    u, _ = jnp.linalg.qr(u[:, :kk])
    v, _ = jnp.linalg.qr(vt[:kk].T)
    return u, s[:kk], v


def subspace_drift(u_prev: Float[Array, "d k"], u_now: Float[Array, "d k"]) -> float:
    """``D = ‖sin Θ(U_now, U_prev)‖_F / √k`` from principal angles (0: same subspace).

    Example::

        >>> import jax.numpy as jnp
        >>> subspace_drift(jnp.eye(3)[:, :2], jnp.eye(3)[:, [1, 0]])
        0.0
    """
    theta = principal_angles(u_prev, u_now)
    return float(jnp.linalg.norm(jnp.sin(theta)) / math.sqrt(u_prev.shape[1]))


def capture_ratio(step: Array, u: Array, v: Array) -> float:
    """``κ = ‖U Uᵀ δ V Vᵀ‖² / ‖δ‖²``: share of the current step inside the locked subspace."""
    inside = u @ (u.T @ step @ v) @ v.T
    return float(jnp.sum(jnp.square(inside)) / jnp.maximum(jnp.sum(jnp.square(step)), 1e-30))


class LockinMonitor:
    """Host-side probe of the cumulative update ``ΔW_t`` of selected matrices (DERIVED).

    Call :meth:`update` every few steps with the current matrices; it records stable/effective
    rank of ``ΔW_t``, subspace drift ``D_t`` (max over left/right), the capture ratio of the
    step since the previous probe, and declares lock-in ``T_lock`` at the first probe where
    ``D_t < lock_tol`` for ``lock_patience`` consecutive probes while ``‖ΔW‖_F`` grows. With
    ``curvatures`` it adds the sharp fraction, channelling index and the harm signal ``h_t``.

    Not an optax transform (the spec's ``lockin_probe``): a plain object fed by the user's loop,
    which keeps it usable on checkpoints too.

    Example::

        >>> import jax.numpy as jnp
        >>> w0 = {"w": jnp.zeros((4, 3))}
        >>> mon = LockinMonitor(w0, k=1, lock_patience=2)
        >>> d = jnp.outer(jnp.arange(4.0), jnp.ones(3))
        >>> for t in range(1, 5):
        ...     _ = mon.update({"w": t * d}, step=t)
        >>> mon.t_lock
        3
    """

    def __init__(self, params0: dict, curvatures: dict | None = None, *, k: int = 8,
                 lock_tol: float = 0.1, lock_patience: int = 3, energy: float = 0.9):
        self.params0 = {n: jnp.asarray(w) for n, w in params0.items()}
        self.k, self.lock_tol, self.lock_patience = k, lock_tol, lock_patience
        self.curvatures = curvatures or {}
        self.bases = {n: curvature_basis(c, energy=energy) for n, c in self.curvatures.items()}
        self.prev: dict = {}
        self.t_lock: int | None = None
        self._calm = 0
        self.history: list[dict] = []

    def update(self, params: dict, step: int) -> dict:
        per_layer, drifts, grows = {}, [], []
        deltas = {}
        for name, w0 in self.params0.items():
            w = jnp.asarray(params[name])
            delta = w - w0
            deltas[name] = delta
            u, s, v = top_subspaces(delta, self.k)
            norm = float(jnp.linalg.norm(delta))
            rec = {"stable_rank": float(stable_rank(s)) if norm > 0 else 0.0,
                   "effective_rank": float(effective_rank(s)) if norm > 0 else 0.0,
                   "norm": norm}
            if name in self.prev:
                pu, pv, pnorm, pw = self.prev[name]
                rec["drift"] = max(subspace_drift(pu, u), subspace_drift(pv, v))
                rec["capture"] = capture_ratio(w - pw, pu, pv)
                drifts.append(rec["drift"])
                grows.append(norm > pnorm)
            if name in self.bases:
                rec.update(sharp_fraction(delta, self.bases[name]))
            self.prev[name] = (u, v, norm, w)
            per_layer[name] = rec
        out = {"step": step, "per_layer": per_layer}
        if drifts:
            out["drift"] = float(max(drifts))
            calm = out["drift"] < self.lock_tol and all(grows)
            self._calm = self._calm + 1 if calm else 0
            if self.t_lock is None and self._calm >= self.lock_patience:
                self.t_lock = step
        if self.curvatures:
            out["harm"] = harm_signal({n: deltas[n] for n in self.curvatures}, self.curvatures)[
                "total"]
        out["t_lock"] = self.t_lock
        self.history.append(out)
        return out


__all__ = [
    "CurvatureBasis", "LockinMonitor", "capture_ratio", "curvature_basis", "harm_signal",
    "local_kfac", "project_sharp", "project_soft", "rayleigh_quotient", "sharp_fraction",
    "subspace_drift", "top_subspaces",
]
