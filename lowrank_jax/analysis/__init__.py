"""Spectral analysis of weights and representations: ranks, spectra, Diffract-style checkpoint
comparison, per-head analysis, CKA, Kruskal rank, update-subspace probes, orbax streaming."""

from lowrank_jax.analysis.checkpoint import (
    check_same_architecture,
    checkpoint_shapes,
    compare_checkpoints,
    iter_checkpoint_matrices,
    restore_leaf,
    restore_params,
    save_params,
)
from lowrank_jax.analysis.cka import (
    cka_matrix,
    hsic_biased,
    hsic_unbiased,
    kernel_cka,
    linear_cka,
    minibatch_cka,
    rbf_cka,
)
from lowrank_jax.analysis.heads import (
    head_scores,
    interpolate,
    loss_barrier,
    merge_heads,
    rewind_curve,
    rewind_heads,
    select_heads,
    split_heads,
)
from lowrank_jax.core.kruskal import (
    coherence,
    khatri_rao,
    kruskal_penalty,
    kruskal_rank_bounds,
    kruskal_rank_exact,
    numerical_krank,
)
from lowrank_jax.core.svd import (
    singular_values,
    singular_values_gram,
    svd_exact,
)
from lowrank_jax.core.linalg import randomized_svd  # the one randomized SVD
from lowrank_jax.analysis.lockin_optax import (
    LockinProbeState,
    lockin_probe,
    probe_metrics,
)
from lowrank_jax.analysis.probes import (
    LockinMonitor,
    capture_ratio,
    curvature_basis,
    harm_signal,
    local_kfac,
    project_sharp,
    project_soft,
    rayleigh_quotient,
    sharp_fraction,
    subspace_drift,
)
from lowrank_jax.core.rank import (
    alpha_req,
    anisotropy,
    effective_rank,
    effective_rank_of,
    energy_rank,
    energy_rank_of,
    isotropy_partition,
    numerical_rank,
    numerical_rank_of,
    rankme,
    stable_rank,
    stable_rank_of,
)
from lowrank_jax.analysis.spectra import (
    compare_matrices,
    esd,
    matrix_summary,
    mp_edge,
    mp_spike_count,
    powerlaw_alpha,
    principal_angles,
    singular_overlap,
    spectral_share,
)

__all__ = [
    "LockinMonitor", "LockinProbeState", "alpha_req", "anisotropy", "capture_ratio",
    "check_same_architecture", "checkpoint_shapes", "cka_matrix", "coherence",
    "compare_checkpoints", "compare_matrices", "curvature_basis", "effective_rank",
    "effective_rank_of", "energy_rank", "energy_rank_of", "esd", "harm_signal", "head_scores",
    "hsic_biased", "hsic_unbiased", "interpolate", "isotropy_partition",
    "iter_checkpoint_matrices", "kernel_cka", "khatri_rao", "kruskal_penalty",
    "kruskal_rank_bounds", "kruskal_rank_exact", "linear_cka", "local_kfac", "lockin_probe",
    "loss_barrier",
    "matrix_summary", "merge_heads", "minibatch_cka", "mp_edge", "mp_spike_count",
    "numerical_krank", "numerical_rank", "numerical_rank_of", "powerlaw_alpha", "principal_angles",
    "probe_metrics", "project_sharp", "project_soft", "randomized_svd", "rankme",
    "rayleigh_quotient", "rbf_cka", "restore_leaf", "restore_params", "rewind_curve",
    "rewind_heads",
    "save_params", "select_heads", "sharp_fraction", "singular_overlap", "singular_values",
    "singular_values_gram", "spectral_share", "split_heads", "stable_rank", "stable_rank_of",
    "subspace_drift", "svd_exact",
]
