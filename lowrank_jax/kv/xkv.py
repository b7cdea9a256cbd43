"""xKV: cross-layer low-rank KV-cache compression with selective reconstruction.

After prefill, the pre-RoPE keys of ``G`` adjacent layers are concatenated along the feature axis
and factorized with one truncated SVD per group (values likewise, separately):

.. math::

    X_g = [K^{(l_1)} \\,|\\, \\dots \\,|\\, K^{(l_G)}] \\in \\mathbb{R}^{L \\times G H_{kv} D}
    \\approx U_r \\Sigma_r V_r^\\top,\\qquad A_g = U_r,\\quad B_g = \\Sigma_r V_r^\\top,

so the group stores one shared token factor ``A_g`` ``[L, r]`` and, per layer, the column block
``B^{(l)}`` of ``B_g`` reshaped to ``[H_kv, r, D]``. Keys are rebuilt as ``RoPE(A_g B^{(l)}_h)``
at decode time; tokens generated after the prompt are kept exact (post-RoPE).

The code is split by concern: :mod:`~lowrank_jax.kv.ranks` (layer groups, rank choice),
:mod:`~lowrank_jax.kv.cache` (the cache pytrees and byte accounting),
:mod:`~lowrank_jax.kv.compress` (the grouped SVD and reconstruction),
:mod:`~lowrank_jax.kv.selective` (selective reconstruction at decode) and
:mod:`~lowrank_jax.kv.model` (K/V providers that plug the compressed cache into the one Llama
forward: prefill, decode, generation) and :mod:`~lowrank_jax.kv.evaluate` (the perplexity
protocol and the CLI factory). This module re-exports the public names. The per-layer SVD
baseline is the same code with ``group_size=1``.

References:
    Chang et al, `xKV: Cross-Layer KV-Cache Compression via Aligned Singular Vector
    Extraction <https://arxiv.org/abs/2503.18893>`_, 2025.
    Sun et al, `ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference
    <https://arxiv.org/abs/2410.21465>`_, 2024 (selective reconstruction).
"""

from lowrank_jax.kv.cache import (
    SelectiveConfig,
    SelectiveState,
    XKVCache,
    compressed_bytes,
    compression_ratio,
    uncompressed_bytes,
)
from lowrank_jax.kv.compress import xkv_compress, xkv_reconstruct
from lowrank_jax.kv.evaluate import (
    XKVCacheFactory,
    xkv_cache_factory,
    xkv_perplexity,
    xkv_perplexity_sweep,
    xkv_windowed_perplexity,
)
from lowrank_jax.kv.model import (
    ContextKV,
    PrefillKV,
    XKVDecodeKV,
    prefill_kv,
    xkv_decode_step,
    xkv_generate,
    xkv_prefill,
)
from lowrank_jax.kv.ranks import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SINK_TOKENS,
    DEFAULT_VALUE_RANK_SCALE,
    choose_ranks,
    layer_groups,
    predicted_compression_ratio,
)
from lowrank_jax.kv.methods import KV_METHODS
from lowrank_jax.kv.selective import selective_decode_attention

__all__ = [
    "ContextKV", "DEFAULT_GROUP_SIZE", "DEFAULT_SINK_TOKENS", "DEFAULT_VALUE_RANK_SCALE",
    "KV_METHODS", "PrefillKV", "SelectiveConfig", "SelectiveState", "XKVCache", "XKVCacheFactory",
    "XKVDecodeKV", "choose_ranks", "compressed_bytes", "compression_ratio", "layer_groups",
    "predicted_compression_ratio", "prefill_kv", "selective_decode_attention", "uncompressed_bytes",
    "xkv_cache_factory", "xkv_compress", "xkv_decode_step", "xkv_generate", "xkv_perplexity",
    "xkv_perplexity_sweep", "xkv_prefill", "xkv_reconstruct", "xkv_windowed_perplexity",
]
