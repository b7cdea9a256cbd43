"""Optimal transport: low-rank OT by transport clustering (:mod:`.transport_clustering`)."""

from lowrank_jax.ot.transport_clustering import (
    LowRankPlan,
    full_rank_plan,
    gkmeans,
    gkmeans_factored,
    lr_cost,
    lr_cost_factored,
    plan_matrix,
    point_cost,
    register_cost,
    register_factors,
    sinkhorn,
    sqeuclidean_factors,
    transport_clustering,
)

__all__ = [
    "LowRankPlan", "full_rank_plan", "gkmeans", "gkmeans_factored", "lr_cost",
    "lr_cost_factored", "plan_matrix", "point_cost", "register_cost", "register_factors",
    "sinkhorn", "sqeuclidean_factors", "transport_clustering",
]
