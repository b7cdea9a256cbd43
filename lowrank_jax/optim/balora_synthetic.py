"""BaLoRA vs LoRA on the paper's synthetic low-rank regression (Castin et al, Fig. 3).

Problem (as in the official ``synthetic/synthetic_loss.py``): a frozen ``W0`` and a target ``T``
(``n × m``, entries N(0, 1)); a LoRA pair ``L`` (``n × r``, zeros) and ``R`` (``r × m``, N(0, 1));
loss ``½‖W0 + L R − T‖²``; 100 steps of the sign-like update ``p ← p − lr · g / (|g| + 1e-8)``
(what the reference calls "adam"). BaLoRA re-projects ``(L, R)`` onto the balanced manifold after
every step with :func:`lowrank_jax.optim.balora.balance_pair` (mode ``"svd"``, the reference;
``"procrustes"`` is run as an extra). The best reachable loss is
``L* = ½ Σ_{i>r} σ_i(T − W0)²`` (Eckart–Young), and we report the excess ``loss − L*``.

Learning rates: ``linspace(1e-5, 0.3, 50)``. As in the reference, a run whose loss exceeds 1e5
counts as diverged, and the best learning rate is chosen per seed and per method by final loss
(``--select shared`` picks one learning rate per method, by the median final loss over seeds).
Seeds change the LoRA initialisation; the problem ``(W0, T)`` is fixed (the reference's protocol)
unless ``--resample-problem`` draws a new ``(W0, T)`` per seed. Everything (methods × seeds ×
learning rates × steps) runs as one jitted ``lax.map``/``vmap``/``lax.scan`` per method.

The script ``scripts/reproduce/balora_synthetic.py`` runs the full study and plots it.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.optim.balora import balance_pair, balancing_gap

DIVERGED = 1e5  # the reference's threshold: a run whose loss goes above it is discarded


class Problem(NamedTuple):
    """One synthetic fine-tuning problem: frozen weight, target, LoRA init (all float32)."""

    w0: jax.Array  # [n, m]
    target: jax.Array  # [n, m]
    left: jax.Array  # [n, r], zeros (LoRA's B = 0)
    right: jax.Array  # [r, m], N(0, 1)


def make_problems(seeds: int, *, n: int = 20, m: int = 20, rank: int = 4,
                  resample_problem: bool = False, problem_seed: int = 44,
                  init_seed: int = 57) -> Problem:
    """``seeds`` problems stacked on a leading axis (``(W0, T)`` shared unless resampled)."""
    if seeds < 1 or rank < 1 or rank > min(n, m):
        raise ValueError(f"make_problems: need seeds >= 1 and 1 <= rank <= min(n, m); got "
                         f"seeds={seeds}, rank={rank}, n={n}, m={m}.")
    kt, kw = jax.random.split(jax.random.key(problem_seed))
    if resample_problem:
        kts = jax.random.split(kt, seeds)
        kws = jax.random.split(kw, seeds)
        target = jax.vmap(lambda k: jax.random.normal(k, (n, m)))(kts)
        w0 = jax.vmap(lambda k: jax.random.normal(k, (n, m)))(kws)
    else:
        target = jnp.broadcast_to(jax.random.normal(kt, (n, m)), (seeds, n, m))
        w0 = jnp.broadcast_to(jax.random.normal(kw, (n, m)), (seeds, n, m))
    inits = jax.random.split(jax.random.key(init_seed), seeds)
    right = jax.vmap(lambda k: jax.random.normal(k, (rank, m)))(inits)
    left = jnp.zeros((seeds, n, rank))
    return Problem(w0, target, left, right)


def optimal_loss(w0: jax.Array, target: jax.Array, rank: int) -> jax.Array:
    """``L* = ½ Σ_{i>r} σ_i(T − W0)²``: the best loss a rank-``r`` correction can reach."""
    sigma = jnp.linalg.svd(target - w0, compute_uv=False)
    return 0.5 * jnp.sum(sigma[..., rank:] ** 2, axis=-1)


def _loss(left, right, w0, target):
    return 0.5 * jnp.sum((w0 + left @ right - target) ** 2)


def trajectory(problem: Problem, lr, *, steps: int, balanced: str | None):
    """Losses and balancing gaps at steps ``0..steps`` of one run (single problem, scalar lr).

    ``balanced`` is ``None`` (LoRA) or a :func:`balance_pair` mode (BaLoRA: project after every
    update). The update is the reference's sign-like ``g / (|g| + 1e-8)``.
    """

    def step(carry, _):
        left, right = carry
        loss, (g_l, g_r) = jax.value_and_grad(_loss, argnums=(0, 1))(
            left, right, problem.w0, problem.target)
        gap = balancing_gap(left, right)
        left = left - lr * g_l / (jnp.abs(g_l) + 1e-8)
        right = right - lr * g_r / (jnp.abs(g_r) + 1e-8)
        if balanced is not None:
            left, right = balance_pair(left, right, mode=balanced)
        return (left, right), (loss, gap)

    (left, right), (losses, gaps) = jax.lax.scan(step, (problem.left, problem.right), None,
                                                 length=steps)
    losses = jnp.append(losses, _loss(left, right, problem.w0, problem.target))
    gaps = jnp.append(gaps, balancing_gap(left, right))
    return losses, gaps


def sweep(problems: Problem, lrs: jax.Array, *, steps: int, balanced: str | None):
    """``(losses, gaps)`` of shape ``[seeds, lrs, steps + 1]``: one jit, vmap over lrs.

    Seeds go through ``lax.map``, not a second ``vmap``: on jax 0.10.2's CPU backend the doubly
    vmapped BaLoRA scan (batched QR/SVD inside ``lax.scan``) sometimes never returns from
    ``block_until_ready`` (every time with ``jax_cpu_enable_async_dispatch=False``).
    """
    run = lambda p, lr: trajectory(p, lr, steps=steps, balanced=balanced)
    over_lrs = jax.vmap(run, in_axes=(None, 0))
    return jax.jit(lambda ps, ls: jax.lax.map(lambda p: over_lrs(p, ls), ps))(problems, lrs)


def _select(losses: np.ndarray, how: str = "per_seed") -> np.ndarray:
    """Index of the best learning rate per seed (``[seeds]``) by final loss; diverged runs lose.

    ``how="per_seed"`` is the reference's rule; ``"shared"`` picks one index for all seeds by the
    median final loss.
    """
    diverged = ~np.all(np.isfinite(losses), axis=-1) | np.any(losses > DIVERGED, axis=-1)
    final = np.where(diverged, np.inf, losses[..., -1])  # [seeds, lrs]
    if how == "per_seed":
        return np.argmin(final, axis=1)
    if how == "shared":
        return np.full(final.shape[0], np.argmin(np.median(final, axis=0)))
    raise ValueError(f"select: how={how!r} is unknown; use 'per_seed' or 'shared'.")


def run_study(*, seeds: int = 8, lrs: np.ndarray | None = None, steps: int = 100,
              n: int = 20, m: int = 20, rank: int = 4, resample_problem: bool = False,
              methods: tuple[tuple[str, str | None], ...] = (("LoRA", None), ("BaLoRA", "svd")),
              how: str = "per_seed") -> dict:
    """Run every method over seeds × learning rates; per seed keep the best lr's trajectory.

    Returns ``{"l_star": [seeds], "methods": {name: {"excess": [seeds, steps+1],
    "gap": [seeds, steps+1], "lr": [seeds], "seconds": float}}}`` (numpy arrays).
    """
    lrs = np.linspace(1e-5, 0.3, 50) if lrs is None else np.asarray(lrs)
    problems = make_problems(seeds, n=n, m=m, rank=rank, resample_problem=resample_problem)
    l_star = np.asarray(optimal_loss(problems.w0, problems.target, rank))
    out = {"l_star": l_star, "methods": {}}
    for name, balanced in methods:
        start = time.perf_counter()
        losses, gaps = jax.block_until_ready(
            sweep(problems, jnp.asarray(lrs, jnp.float32), steps=steps, balanced=balanced))
        seconds = time.perf_counter() - start
        losses, gaps = np.asarray(losses, np.float64), np.asarray(gaps, np.float64)
        best = _select(losses, how)
        rows = np.arange(seeds)
        out["methods"][name] = {
            "excess": losses[rows, best] - l_star[:, None],
            "gap": gaps[rows, best],
            "lr": lrs[best],
            "diverged_lrs": int(np.sum(np.any(~np.isfinite(losses) | (losses > DIVERGED),
                                              axis=-1)[0])),
            "seconds": seconds,
        }
    return out
