"""Reproduce FedHera and FedTreeLoRA against their baselines on real text, CPU scale.

Runs configs/fed_hera.yaml and configs/fed_tree.yaml (topic classification of standard-library
docstring sentences by heterogeneous clients; frozen MLP + rank-16 LoRA), 3 seeds each, prints
one table per method family (global and personalised accuracy, mean ± std over seeds), and saves
the accuracy-per-round plots to docs/img/ (--quick: to runs/) and the histories to runs/.
Then the FedTreeLoRA spec's synthetic deep-linear study (held-out MSE and the chosen k_l).
Full runs keep per-round checkpoints under runs/: delete them to measure afresh.

    python scripts/reproduce/federated.py            # the full runs (~7 min on 2 busy cores)
    python scripts/reproduce/federated.py --quick    # 1 seed, 8 rounds (~1 min)
"""

from __future__ import annotations

import os

# One BLAS thread: the server's per-layer SVDs are tiny, and a threaded OpenBLAS on shared cores
# was measured 100-1000x slower. Must be set before NumPy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import pathlib
import time

import numpy as np

from lowrank_jax import federated as fed
from lowrank_jax.federated import experiment, synthetic

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_one(config_name: str, quick: bool, progress: bool) -> dict:
    run_dir = ROOT / "runs" / (f"reproduce_{config_name}" + ("_quick" if quick else ""))
    overrides = {"run_dir": str(run_dir),
                 "checkpoint": not quick}
    if quick:
        overrides["seeds"] = [0]
    config = experiment.load_experiment(str(ROOT / "configs" / f"{config_name}.yaml"), overrides)
    if quick:
        config.schedule = {**config.schedule, "rounds": 8}
    start = time.time()
    results = experiment.run_federated(config, progress=progress)
    summary = experiment.summarize(results, last=3 if quick else 5)
    experiment.save_results(results, summary, config)
    image = (run_dir / "accuracy.png" if quick  # keep docs/img for full runs
             else ROOT / "docs" / "img" / f"{config_name}_accuracy.png")
    experiment.plot_accuracy(results, str(image), title=f"{config.name} (mean ± std over "
                                                         f"{len(config.seeds)} seeds)")
    print(f"\n## {config.name}: {len(config.seeds)} seed(s), {config.schedule['rounds']} rounds, "
          f"{time.time() - start:.0f} s\n")
    print(experiment.format_summary(summary))
    for name, s in summary.items():
        if "depths" in s:
            print(f"\n{name}: groups per adapted layer k_l (shallow -> deep), per seed: "
                  f"{s['depths']}")
    print(f"\nplot: {image.relative_to(ROOT)}")
    return summary


def run_synthetic(quick: bool, progress: bool) -> dict:
    """The spec's deep-linear study: 8 layers, 16 clients in 4 groups, held-out MSE."""
    seeds = [0] if quick else [0, 1, 2]
    rounds = 10 if quick else 30
    methods = {
        "fedtreelora (spec: warm-up 3, tau 0.5, rebuild 5)": fed.FedTreeLoRA(),
        "fedtreelora (warm-up 1, one build)": fed.FedTreeLoRA(warmup_rounds=1,
                                                              rebuild_every=10**6),
        "fedtreelora (warm-up 1, one build, tau 0.7)": fed.FedTreeLoRA(
            warmup_rounds=1, rebuild_every=10**6, tau=0.7),
        "flat clustering k=4 (same tree)": fed.FedTreeLoRA(flat_groups=4, warmup_rounds=1,
                                                           rebuild_every=10**6),
        "fedsa": fed.FedSA(),
        "fedavg": fed.FedAvgLoRA(),
        "local": fed.LocalOnly(),
    }
    start = time.time()
    results = synthetic.deep_linear_study(methods, seeds=seeds, rounds=rounds, progress=progress)
    print(f"\n## synthetic deep linear (8 layers, 16 clients in 4 groups): {len(seeds)} seed(s), "
          f"{rounds} rounds, {time.time() - start:.0f} s\n")
    print("| strategy | personalised held-out MSE (last 5) | k_l per layer (last build) |")
    print("|---|---|---|")
    summary = {}
    for name, r in results.items():
        mse = np.array(r["mse"])
        summary[name] = {"mse": (float(mse.mean()), float(mse.std())), "depths": r["depths"]}
        depths = "; ".join(str(tuple(d)) for d in r["depths"]) or "—"
        print(f"| {name} | {mse.mean():.4f} ± {mse.std():.4f} | {depths} |")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 8 rounds")
    parser.add_argument("--only", choices=("fed_hera", "fed_tree", "synthetic"), default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    names = [args.only] if args.only else ["fed_hera", "fed_tree", "synthetic"]
    summaries = {n: run_synthetic(args.quick, not args.no_progress) if n == "synthetic"
                 else run_one(n, args.quick, not args.no_progress) for n in names}
    out = ROOT / "runs" / f"reproduce_federated{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summaries, indent=1))
    print(f"\nsummary: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
