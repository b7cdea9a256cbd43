"""Federated LoRA: FedHera and FedTreeLoRA aggregation rules, baselines, and a client simulator.

* :mod:`~lowrank_jax.federated.fedhera` — pure rules: dense / unbiased merge, SVD push with the
  scale folded in, water-filling of download and train ranks, prefix gating, tail warm-up.
* :mod:`~lowrank_jax.federated.fedtreelora` — pure rules: B-similarity tree, cuts, per-layer
  depths, group averaging.
* :mod:`~lowrank_jax.federated.strategies` — server loops (FedHera, FlexLoRA, HetLoRA,
  FedAvg-LoRA, FedSA, FedTreeLoRA, local-only) for :func:`simulate`.
* :mod:`~lowrank_jax.federated.tasks` — heterogeneous clients on real text (topic
  classification of standard-library docstring sentences).
* :mod:`~lowrank_jax.federated.synthetic` — the FedTreeLoRA spec's deep-linear study.
* :mod:`~lowrank_jax.federated.experiment` — YAML-configured runs, summaries and plots
  (``lowrank-jax federate``).
"""

from lowrank_jax.federated import fedhera, fedtreelora
from lowrank_jax.federated.simulator import (
    METRICS,
    AdapterModel,
    Client,
    FederatedResult,
    FederationContext,
    client_batches,
    select_clients,
    simulate,
    token_window_client,
)
from lowrank_jax.federated.strategies import (
    FedAvgLoRA,
    FedHera,
    FedSA,
    FedTreeLoRA,
    FlexLoRA,
    HetLoRA,
    LocalOnly,
)

__all__ = [
    "METRICS",
    "AdapterModel",
    "Client",
    "FedAvgLoRA",
    "FedHera",
    "FedSA",
    "FedTreeLoRA",
    "FederatedResult",
    "FederationContext",
    "FlexLoRA",
    "HetLoRA",
    "LocalOnly",
    "client_batches",
    "fedhera",
    "fedtreelora",
    "select_clients",
    "simulate",
    "token_window_client",
]
