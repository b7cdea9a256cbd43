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

Usage::

    python -m scripts.reproduce.balora_synthetic                 # 8 seeds × 50 lrs, seconds
    python -m scripts.reproduce.balora_synthetic --resample-problem \
        --out runs/balora_synth_resampled

Writes ``<out>/results.json`` and ``<out>/synthetic.png`` (median excess loss, log scale, and
median balancing gap ``‖LᵀL − R Rᵀ‖_F`` per step).
"""

from __future__ import annotations

import argparse
import json
import os
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


def select(losses: np.ndarray, how: str = "per_seed") -> np.ndarray:
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
        best = select(losses, how)
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/reproduce_balora_synthetic")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--n-lrs", type=int, default=50, help="lrs in linspace(1e-5, 0.3, N)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--resample-problem", action="store_true",
                   help="draw a new (W0, T) per seed (default: one problem, seeds vary the init)")
    p.add_argument("--select", default="per_seed", choices=("per_seed", "shared"))
    p.add_argument("--no-procrustes", action="store_true",
                   help="skip the extra BaLoRA run with mode='procrustes'")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    methods = [("LoRA", None), ("BaLoRA", "svd")]
    if not args.no_procrustes:
        methods.append(("BaLoRA-procrustes", "procrustes"))
    start = time.perf_counter()
    res = run_study(seeds=args.seeds, lrs=np.linspace(1e-5, 0.3, args.n_lrs), steps=args.steps,
                    rank=args.rank, resample_problem=args.resample_problem,
                    methods=tuple(methods), how=args.select)
    total = time.perf_counter() - start
    steps = args.steps
    checkpoints = [10, 25, 50, steps]
    header = ("| method | best lr (median; range) | median excess loss at step "
              + " / ".join(str(c) for c in checkpoints)
              + f" | seeds with excess < LoRA's (step {steps}) | median ‖LᵀL−RRᵀ‖_F at step 0 / "
              f"{steps // 2} / {steps} | diverged lrs (seed 0) |")
    lines = [header, "|---|---|---|---|---|---|"]
    lora_final = res["methods"]["LoRA"]["excess"][:, -1]
    summary = {}
    for name, r in res["methods"].items():
        med = np.median(r["excess"], axis=0)
        gap = np.median(r["gap"], axis=0)
        wins = int(np.sum(r["excess"][:, -1] < lora_final))
        lines.append(
            f"| {name} | {np.median(r['lr']):.4g}; {r['lr'].min():.4g}–{r['lr'].max():.4g} | "
            + " / ".join(f"{med[c]:.3g}" for c in checkpoints)
            + f" | {wins if name != 'LoRA' else '—'}/{args.seeds} | "
            f"{gap[0]:.3g} / {gap[steps // 2]:.3g} / {gap[-1]:.3g} | {r['diverged_lrs']} |")
        summary[name] = {"median_excess": med.tolist(), "median_gap": gap.tolist(),
                         "lr": r["lr"].tolist(), "final_excess": r["excess"][:, -1].tolist(),
                         "seconds": r["seconds"]}
    table = "\n".join(lines)
    print(f"L* (median over seeds) = {np.median(res['l_star']):.4f}; "
          f"{args.seeds} seeds × {args.n_lrs} lrs × {steps} steps; total {total:.1f} s "
          "(includes compilation)")
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "l_star": res["l_star"].tolist(), "methods": summary,
                   "table": table, "seconds": total}, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing (pip install matplotlib): no plot written")
        return 0
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    styles = {"LoRA": ("C1", "-"), "BaLoRA": ("C0", "-"), "BaLoRA-procrustes": ("C2", "--")}
    x = np.arange(steps + 1)
    for name, r in res["methods"].items():
        color, ls = styles.get(name, ("C3", ":"))
        q = np.quantile(r["excess"], [0.25, 0.5, 0.75], axis=0)
        ax1.semilogy(x, q[1], color=color, ls=ls,
                     label=f"{name} (median lr {np.median(r['lr']):.3g})")
        ax1.fill_between(x, q[0], q[2], color=color, alpha=0.2)
        g = np.quantile(r["gap"], [0.25, 0.5, 0.75], axis=0)
        ax2.semilogy(x, np.maximum(g[1], 1e-8), color=color, ls=ls, label=name)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss − L*  (median, IQR band)")
    ax1.set_title(f"n=m=20, r={args.rank}, {args.seeds} seeds", fontsize=9)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("step")
    ax2.set_ylabel("‖LᵀL − RRᵀ‖_F (median, floor 1e-8)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "synthetic.png"), dpi=120)
    print(f"wrote {args.out}/results.json and synthetic.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
