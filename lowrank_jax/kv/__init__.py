"""KV-cache compression: xKV cross-layer low-rank factors with selective reconstruction."""

from lowrank_jax.kv.xkv import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SINK_TOKENS,
    METHODS,
    ContextKV,
    PrefillKV,
    SelectiveConfig,
    SelectiveState,
    XKVCache,
    XKVCacheFactory,
    XKVDecodeKV,
    choose_ranks,
    compressed_bytes,
    compression_ratio,
    layer_groups,
    predicted_compression_ratio,
    prefill_kv,
    selective_decode_attention,
    uncompressed_bytes,
    xkv_cache_factory,
    xkv_compress,
    xkv_decode_step,
    xkv_generate,
    xkv_perplexity,
    xkv_perplexity_sweep,
    xkv_prefill,
    xkv_reconstruct,
    xkv_windowed_perplexity,
)

__all__ = [
    "DEFAULT_GROUP_SIZE", "DEFAULT_SINK_TOKENS", "METHODS", "SelectiveConfig", "SelectiveState", "XKVCache",
    "XKVCacheFactory", "ContextKV", "PrefillKV", "XKVDecodeKV", "prefill_kv", "choose_ranks", "compressed_bytes", "compression_ratio", "layer_groups",
    "predicted_compression_ratio", "selective_decode_attention", "uncompressed_bytes",
    "xkv_cache_factory", "xkv_compress", "xkv_decode_step", "xkv_generate", "xkv_perplexity",
    "xkv_perplexity_sweep", "xkv_prefill", "xkv_reconstruct", "xkv_windowed_perplexity",
]
