"""Flash attention (FlashAttention-2) as a Pallas kernel with a jnp reference twin."""

from pallas_kernels.flash_attention.api import (
    BlockSizes,
    flash_attention,
    resolve_implementation,
)
from pallas_kernels.flash_attention.reference import (
    attention_reference,
    flash_attention_reference,
)

__all__ = ["BlockSizes", "attention_reference", "flash_attention", "flash_attention_reference",
           "resolve_implementation"]
