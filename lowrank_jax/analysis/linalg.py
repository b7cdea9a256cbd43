"""SVD backends for analysis (exact, singular values, Gram-streaming).

They live at the ground floor, :mod:`lowrank_jax.core.svd`.
"""

from lowrank_jax.core.svd import (
    singular_values,
    singular_values_gram,
    svd_exact,
)

__all__ = [
    "singular_values",
    "singular_values_gram",
    "svd_exact",
]
