"""Models: the one Llama-style decoder forward (with its three extension points), loading and
writing checkpoints (GGUF, safetensors, presets), tokenizers,
generation and perplexity. Loading any model folder (quantized, PEFT, a hub name) is
:mod:`lowrank_jax.hub`, one floor up."""

from lowrank_jax.models.generate import english_eval_text, forward, generate, perplexity, prepare
from lowrank_jax.models.gguf import load_gguf
from lowrank_jax.models.llama import (
    CausalKV,
    KVCache,
    KVProvider,
    Llama,
    LlamaConfig,
    count_params,
    projections,
    replace_projections,
)
from lowrank_jax.models.packed import PackedKV
from lowrank_jax.models.presets import PRESETS, preset_config, preset_model
from lowrank_jax.models.safetensors_io import load_hf_checkpoint, save_hf_checkpoint
from lowrank_jax.models.tokenizer import BPETokenizer, ByteTokenizer

__all__ = [
    "BPETokenizer", "ByteTokenizer", "CausalKV", "KVCache", "KVProvider", "Llama", "LlamaConfig",
    "PRESETS", "PackedKV", "count_params", "english_eval_text", "forward",
    "generate", "load_gguf", "load_hf_checkpoint", "perplexity", "prepare",
    "preset_config", "preset_model", "projections", "replace_projections",
    "save_hf_checkpoint",
]
