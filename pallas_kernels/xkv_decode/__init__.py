"""Decode attention over an xKV-compressed KV cache (Pallas kernel + pure-jnp reference)."""

from pallas_kernels.xkv_decode.api import IMPLEMENTATIONS, BlockSizes, xkv_decode_attention
from pallas_kernels.xkv_decode.kernel import xkv_decode_kernel, xkv_decode_partials
from pallas_kernels.xkv_decode.reference import (
    reconstruct,
    rope,
    rope_inverse_frequencies,
    xkv_decode_reference,
)

__all__ = ["BlockSizes", "IMPLEMENTATIONS", "reconstruct", "rope", "rope_inverse_frequencies",
           "xkv_decode_attention", "xkv_decode_kernel", "xkv_decode_partials",
           "xkv_decode_reference"]
