"""Flash attention (FlashAttention-2) as a Pallas kernel with a jnp reference twin."""

from pallas_kernels.flash_attention.api import (
    BlockSizes,
    flash_attention,
    flash_dispatch,
    resolve_implementation,
)
from pallas_kernels.flash_attention.reference import flash_attention_reference

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference", "flash_dispatch",
           "resolve_implementation"]
