"""Dual-stream subspace attention (Video-SVD): Pallas kernel, jnp reference and blocked XLA path."""

from pallas_kernels.subspace_attention.api import (
    BlockSizes,
    implementation_of,
    subspace_attention,
)
from pallas_kernels.subspace_attention.kernel import dual_stream_attention, estimate_flops
from pallas_kernels.subspace_attention.reference import (
    lookup_tables,
    subspace_attention_blocked,
    subspace_attention_reference,
    token_near_mask,
)

__all__ = ["BlockSizes", "dual_stream_attention", "estimate_flops", "lookup_tables",
           "implementation_of", "subspace_attention", "subspace_attention_blocked",
           "subspace_attention_reference", "token_near_mask"]
