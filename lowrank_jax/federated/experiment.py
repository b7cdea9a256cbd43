"""Federated experiments from a YAML config: strategies × seeds on the topic task, a summary,
and a plot of accuracy per round. Behind ``lowrank-jax federate --config configs/fed_*.yaml``.

Config keys (every one optional; see ``configs/fed_hera.yaml``)::

    name, run_dir, checkpoint (bool: per-round orbax checkpoints, resumed on a re-run)
    task:      clients, dirichlet_alpha, train_per_client, test_per_client, label_groups,
               features, tiers: [[name, train_rank, download_rank, probability], ...]
    model:     hidden, depth, rank, alpha
    schedule:  rounds, local_steps, batch_size, learning_rate, participation, execution
    seeds:     [0, 1, 2]
    strategies: [{name: fedhera|flexlora|hetlora|fedavg|fedsa|local|fedtree|clustered,
                  label: shown name, ...keyword arguments of the strategy}]
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np
import yaml

from lowrank_jax.federated import strategies as strat
from lowrank_jax.federated.simulator import simulate
from lowrank_jax.federated.tasks import DEFAULT_TIERS, make_topic_clients, topic_model

STRATEGIES = {
    "fedhera": strat.FedHera,
    "flexlora": strat.FlexLoRA,
    "hetlora": strat.HetLoRA,
    "fedavg": strat.FedAvgLoRA,
    "fedsa": strat.FedSA,
    "local": strat.LocalOnly,
    "fedtree": strat.FedTreeLoRA,
    "clustered": lambda groups=4, **kw: strat.FedTreeLoRA(flat_groups=groups, name="clustered",
                                                          **kw),
}


ALLOWED_KEYS = {
    "task": {"clients", "dirichlet_alpha", "train_per_client", "test_per_client", "label_groups",
             "features", "tiers"},
    "model": {"hidden", "depth", "rank", "alpha"},
    "schedule": {"rounds", "local_steps", "batch_size", "learning_rate", "participation",
                 "execution"},
}


@dataclasses.dataclass
class FederatedConfig:
    name: str = "federated"
    run_dir: str = "runs/federated"
    checkpoint: bool = True
    task: dict = dataclasses.field(default_factory=dict)
    model: dict = dataclasses.field(default_factory=dict)
    schedule: dict = dataclasses.field(default_factory=dict)
    seeds: list = dataclasses.field(default_factory=lambda: [0])
    strategies: list = dataclasses.field(default_factory=lambda: [{"name": "fedhera"}])

    def __post_init__(self):
        for section, allowed in ALLOWED_KEYS.items():
            unknown = sorted(set(getattr(self, section) or {}) - allowed)
            if unknown:
                raise ValueError(f"{section}: unknown keys {unknown}; known: {sorted(allowed)}.")
        for i, spec in enumerate(self.strategies):
            if not isinstance(spec, dict) or spec.get("name") not in STRATEGIES:
                raise ValueError(f"strategies[{i}]={spec!r}: give a mapping whose 'name' is one "
                                 f"of {sorted(STRATEGIES)}.")
        labels = [label(s) for s in self.strategies]
        if len(set(labels)) != len(labels):
            raise ValueError(f"strategy labels must be unique (got {labels}); set 'label:'.")
        if not self.seeds:
            raise ValueError("seeds is empty; give at least one seed, e.g. seeds: [0].")


def label(spec: dict) -> str:
    return str(spec.get("label", spec["name"]))


def load_experiment(path: str, overrides: dict | None = None) -> FederatedConfig:
    """Read a YAML config (unknown top-level keys are an error)."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config={path!r} does not exist (try configs/fed_hera.yaml).")
    raw = yaml.safe_load(file.read_text()) or {}
    raw.update(overrides or {})
    known = {f.name for f in dataclasses.fields(FederatedConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}.")
    return FederatedConfig(**raw)


def build_strategy(spec: dict):
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "label")}
    try:
        return STRATEGIES[spec["name"]](**kwargs)
    except TypeError as error:
        raise ValueError(f"strategy {label(spec)!r}: bad options {kwargs}: {error}") from error


def run_federated(config: FederatedConfig, *, progress: bool = True) -> dict:
    """Run every strategy for every seed. Returns ``{label: [history per seed]}``.

    A seed fixes the clients (data, tiers, label maps), the base model and adapter init, the
    client sampling and the batches; all strategies of a seed see the same ones.
    """
    task = dict(config.task)
    tiers = tuple(tuple(t) for t in task.pop("tiers", DEFAULT_TIERS))
    n_clients = int(task.pop("clients", 20))
    schedule = dict(config.schedule)
    results: dict[str, list] = {label(s): [] for s in config.strategies}
    run_dir = pathlib.Path(config.run_dir)
    for seed in config.seeds:
        clients, _ = make_topic_clients(n_clients, seed=seed, tiers=tiers, **task)
        model = topic_model(features=int(task.get("features", 512)), seed=seed, **config.model)
        for spec in config.strategies:
            name = label(spec)
            ckpt = (str(run_dir / "checkpoints" / name / f"seed{seed}") if config.checkpoint
                    else None)
            result = simulate(model, clients, build_strategy(spec), seed=seed, progress=progress,
                              checkpoint_dir=ckpt, description=f"{name} seed {seed}", **schedule)
            history = result.history
            depths = result.state.get("depths") if isinstance(result.state, dict) else None
            if depths is not None:
                history = [{**h, "depths": [int(d) for d in depths]} if i == len(history) - 1
                           else h for i, h in enumerate(history)]
            results[name].append(history)
    return results


def summarize(results: dict, last: int = 5) -> dict:
    """Per strategy: mean ± std over seeds of the final global / personalised accuracy (mean of
    the last ``last`` rounds, which smooths the round-to-round noise of partial participation),
    the best round's global accuracy, and the total bytes downloaded."""
    out = {}
    for name, runs in results.items():
        def stat(values):
            values = np.asarray(values, np.float64)
            return float(values.mean()), float(values.std())

        out[name] = {
            "global_accuracy": stat([np.mean([h["global_accuracy"] for h in r[-last:]])
                                     for r in runs]),
            "personal_accuracy": stat([np.mean([h["personal_accuracy"] for h in r[-last:]])
                                       for r in runs]),
            "best_global_accuracy": stat([max(h["global_accuracy"] for h in r) for r in runs]),
            "megabytes_down": stat([sum(h["bytes_down"] for h in r) / 1e6 for r in runs]),
            "seeds": len(runs),
        }
        depths = [r[-1].get("depths") for r in runs if r and r[-1].get("depths") is not None]
        if depths:
            out[name]["depths"] = depths
    return out


def plot_accuracy(results: dict, path: str, title: str = "") -> None:
    """Mean global and personalised accuracy per round (band: ± std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key in zip(axes, ("global_accuracy", "personal_accuracy")):
        for name, runs in results.items():
            curves = np.array([[h[key] for h in r] for r in runs])
            mean, std = curves.mean(0), curves.std(0)
            rounds = np.arange(1, len(mean) + 1)
            ax.plot(rounds, mean, label=name)
            ax.fill_between(rounds, mean - std, mean + std, alpha=0.15)
        ax.set_xlabel("round")
        ax.set_title(key.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tree(report: dict, labels, path, title: str) -> None:
    """The client tree of :func:`lowrank_jax.federated.fedtreelora.tree_report` (dendrogram,
    leaves named by group) beside FedTreeLoRA's chosen number of groups per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.cluster.hierarchy import dendrogram

    tree = np.asarray(report["tree"], np.float64)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    dendrogram(tree, labels=[f"{d} #{i}" for i, d in enumerate(labels)], ax=ax0,
               leaf_rotation=60, color_threshold=0)
    ax0.set_ylabel("average B-cosine distance")
    ax0.set_title(title, fontsize=9)
    depths = list(report["depths"].values())
    ax1.plot(range(len(depths)), depths, marker=".")
    ax1.set_xlabel("adapted layer (shallow → deep)")
    ax1.set_ylabel("groups k_l")
    ax1.set_ylim(0, len(labels) + 0.5)
    ax1.set_title("FedTreeLoRA groups per layer", fontsize=9)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_results(results: dict, summary: dict, config: FederatedConfig) -> pathlib.Path:
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "results.json"
    payload: dict[str, Any] = {"config": dataclasses.asdict(config), "summary": summary,
                               "histories": results}
    out.write_text(json.dumps(payload, indent=1))
    return out


def format_summary(summary: dict) -> str:
    """A Markdown table of :func:`summarize`'s output."""
    rows = ["| strategy | global acc (last 5) | personalised acc (last 5) | best global "
            "| MB down |",
            "|---|---|---|---|---|"]
    def pm(s, key, scale=100.0, digits=1):
        m, sd = s[key]
        return f"{m * scale:.{digits}f} ± {sd * scale:.{digits}f}"

    for name, s in summary.items():
        rows.append(f"| {name} | {pm(s, 'global_accuracy')} | {pm(s, 'personal_accuracy')} | "
                    f"{pm(s, 'best_global_accuracy')} | {pm(s, 'megabytes_down', 1.0, 2)} |")
    return "\n".join(rows)
