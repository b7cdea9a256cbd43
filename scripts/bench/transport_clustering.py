"""Transport clustering vs ott-jax's low-rank Sinkhorn: transport cost and time, same instances.

Instances (spec §7, scaled up): X from 4 Gaussian blobs in 2-D (centres ~ N(0, 16 I), σ = 0.5),
Y from the same blobs shifted by (1, −0.5); n = m, uniform marginals, squared-Euclidean cost,
rank K = 4. Both solvers see the same cost scaling (ott: ``scale_cost="max_cost"``; ours:
``normalize_cost=True``, the registered cost divided by its max) and are scored by the same
``lr_cost`` on the unscaled cost. ott: ``LRSinkhorn(rank=K, KMeansInitializer)``, 3 seeds
(best and median). Ours: Hungarian registration for n ≤ ``--hungarian-max``, otherwise
entropic Sinkhorn (ε = 1e-2 · max C, 300 iterations), factored clustering, 3 restarts × both sides.

Times are wall-clock seconds of one jitted call after a compile-and-run warm-up, on this
machine, in this run; only the ratios mean anything on a shared CPU. Writes JSON to ``--out``.

Usage::

    python scripts/bench/transport_clustering.py --quick     # n = 200, 1000
    python scripts/bench/transport_clustering.py             # n = 200, 1000, 2000, 10000
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", default=None, help="comma list of n (default 200,1000,2000,10000)")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--iterations", type=int, default=1000, help="our mirror-descent steps")
    p.add_argument("--hungarian-max", type=int, default=2000)
    p.add_argument("--out", default="runs/bench_transport_clustering")
    args = p.parse_args(argv)
    default = "200,1000" if args.quick else "200,1000,2000,10000"
    args.sizes = [int(v) for v in (args.sizes or default).split(",")]
    return args


def instance(n, seed=0):
    import jax
    import jax.numpy as jnp

    kc, kl, kx, ky = jax.random.split(jax.random.key(seed), 4)
    centers = 4.0 * jax.random.normal(kc, (4, 2))
    labels = jax.random.randint(kl, (n,), 0, 4)
    x = centers[labels] + 0.5 * jax.random.normal(kx, (n, 2))
    y = centers[labels] + 0.5 * jax.random.normal(ky, (n, 2)) + jnp.asarray([1.0, -0.5])
    return x, y


def main(argv=None) -> int:
    import jax

    from lowrank_jax.bench import time_compiled as timed
    from lowrank_jax.ot import (
        full_rank_plan,
        lr_cost_factored,
        sqeuclidean_factors,
        transport_clustering,
    )

    try:
        from ott.geometry import pointcloud
        from ott.initializers.linear import initializers_lr
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn_lr
    except ImportError as err:
        raise SystemExit("this benchmark needs the baseline: pip install ott-jax==0.6.0") from err

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for n in args.sizes:
        x, y = instance(n)
        A, B = sqeuclidean_factors(x, y)
        registration = "hungarian" if n <= args.hungarian_max else "sinkhorn"

        def ours(key, x, y, registration=registration):
            return transport_clustering(key, x=x, y=y, rank=args.rank, registration=registration,
                                        factored=True, restarts=3, iterations=args.iterations,
                                        epsilon_rel=1e-2, sinkhorn_iterations=300)

        # points are arguments, not closure constants (XLA would constant-fold n × n costs)
        plan, t_ours = timed(ours, jax.random.key(1), x, y)
        solver = sinkhorn_lr.LRSinkhorn(
            rank=args.rank, initializer=initializers_lr.KMeansInitializer(rank=args.rank))

        def run_ott(key, x, y, solver=solver):
            geom = pointcloud.PointCloud(x, y, scale_cost="max_cost")
            return solver(linear_problem.LinearProblem(geom), rng=key)

        ott_costs, ott_times = [], []
        for seed in range(3):
            out, t = timed(run_ott, jax.random.key(10 + seed), x, y)
            ott_costs.append(float(lr_cost_factored(A, B, out.q, out.r, out.g)))
            ott_times.append(t)
        full = None
        if n <= args.hungarian_max:
            from lowrank_jax.ot import point_cost

            perm = full_rank_plan(point_cost(x, y))
            C = point_cost(x, y)
            full = float(C[np.arange(n), np.asarray(perm)].mean())
        row = {
            "n": n, "registration": registration, "full_rank_ot": full,
            "tc_cost": float(plan.cost), "tc_seconds": t_ours,
            "ott_best_cost": min(ott_costs), "ott_median_cost": float(np.median(ott_costs)),
            "ott_seconds_per_seed": float(np.median(ott_times)),
        }
        row["cost_ratio_tc_over_ott_best"] = row["tc_cost"] / row["ott_best_cost"]
        row["time_ratio_tc_over_ott_3_seeds"] = t_ours / sum(ott_times)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print("\n| n | registration | full-rank OT | TC cost | ott best / median | TC/ott best | "
          "TC s | ott s (3 seeds) | time ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        full = "-" if r["full_rank_ot"] is None else f"{r['full_rank_ot']:.3f}"
        print(f"| {r['n']} | {r['registration']} | {full} | {r['tc_cost']:.3f} | "
              f"{r['ott_best_cost']:.3f} / {r['ott_median_cost']:.3f} | "
              f"{r['cost_ratio_tc_over_ott_best']:.3f} | {r['tc_seconds']:.1f} | "
              f"{3 * r['ott_seconds_per_seed']:.1f} | {r['time_ratio_tc_over_ott_3_seeds']:.2f} |")
    path = os.path.join(args.out, "transport_clustering.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
