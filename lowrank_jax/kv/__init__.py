"""KV-cache compression: xKV cross-layer low-rank factors with selective reconstruction, a
KIVI-style quantized cache, xKV with quantized factors (one width, or bits per singular
direction), and the :data:`KV_METHODS` registry that meets a target ratio with every stored byte
counted."""

from lowrank_jax.kv.compress import SVDCache
from lowrank_jax.kv.evaluate import KVCacheFactory, generate_text_with_kv, kv_cache_factory
from lowrank_jax.kv.hybrid import QuantizedXKVCache, xkv_quant_compress, xkv_quant_reconstruct
from lowrank_jax.kv.mixed import MixedBitsXKVCache, xkv_mixed_compress, xkv_mixed_reconstruct
from lowrank_jax.kv.methods import (
    ExactCache,
    KVMethod,
    ReconstructDecodeKV,
    cache_ratio,
    cache_step,
    compress_kv,
    kv_decode_step,
    get_method,
    kv_generate,
    reconstruct_all,
    reference_bytes,
    start_decode,
    start_kv_decode,
    stored_bytes,
)
from lowrank_jax.kv.quantized import (
    KIVICache,
    QuantizedArray,
    choose_kivi_settings,
    dequantize_kv,
    kivi_compress,
    kivi_reconstruct,
    quantize,
)
from lowrank_jax.kv.xkv import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_SINK_TOKENS,
    KV_METHODS,
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
    "ExactCache", "KIVICache", "KVCacheFactory", "KVMethod", "generate_text_with_kv",
    "kv_cache_factory", "MixedBitsXKVCache", "QuantizedArray", "QuantizedXKVCache",
    "ReconstructDecodeKV", "SVDCache", "cache_ratio", "choose_kivi_settings", "compress_kv",
    "cache_step", "kv_decode_step", "start_kv_decode",
    "dequantize_kv", "get_method", "kivi_compress", "kivi_reconstruct", "kv_generate", "quantize",
    "reconstruct_all", "reference_bytes", "start_decode", "stored_bytes", "xkv_quant_compress",
    "xkv_mixed_compress", "xkv_mixed_reconstruct", "xkv_quant_reconstruct",
    "DEFAULT_GROUP_SIZE", "DEFAULT_SINK_TOKENS", "KV_METHODS", "ContextKV", "PrefillKV",
    "SelectiveConfig", "SelectiveState", "XKVCache", "XKVCacheFactory", "XKVDecodeKV",
    "choose_ranks", "compressed_bytes", "compression_ratio", "layer_groups",
    "predicted_compression_ratio", "prefill_kv", "selective_decode_attention",
    "uncompressed_bytes", "xkv_cache_factory", "xkv_compress", "xkv_decode_step",
    "xkv_generate", "xkv_perplexity", "xkv_perplexity_sweep", "xkv_prefill", "xkv_reconstruct",
    "xkv_windowed_perplexity",
]
