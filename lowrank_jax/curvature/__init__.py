"""Curvature estimates of dense layers: K-FAC factors ``E[a aᵀ]``, ``E[g gᵀ]`` and eigenbases
(the editing application that uses them lives in :mod:`lowrank_jax.editing`)."""

from lowrank_jax.curvature.kfac import (
    KFACEigenbasis,
    KFACFactor,
    KFACFactors,
    add_damping,
    combine_factors,
    dense_layer_paths,
    eigenbasis,
    estimate_kfac_factors,
    layer_statistics,
    lm_batch,
    select_layers,
    tapped_layers,
)

__all__ = [
    "KFACEigenbasis",
    "KFACFactor",
    "KFACFactors",
    "add_damping",
    "combine_factors",
    "dense_layer_paths",
    "eigenbasis",
    "estimate_kfac_factors",
    "layer_statistics",
    "lm_batch",
    "select_layers",
    "tapped_layers",
]
