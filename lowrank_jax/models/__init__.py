"""Models: the Llama-style decoder, real-checkpoint loaders (GGUF, safetensors), tokenizers,
generation and perplexity."""

from lowrank_jax.models.generate import english_eval_text, generate, perplexity
from lowrank_jax.models.gguf import load_gguf
from lowrank_jax.models.hub import factorize_projections, load_model, resolve_model
from lowrank_jax.models.llama import KVCache, Llama, LlamaConfig, count_params
from lowrank_jax.models.safetensors_io import load_hf_checkpoint, save_hf_checkpoint
from lowrank_jax.models.tokenizer import BPETokenizer, ByteTokenizer

__all__ = [
    "BPETokenizer", "ByteTokenizer", "KVCache", "Llama", "LlamaConfig", "count_params",
    "english_eval_text", "factorize_projections", "generate", "load_gguf", "load_hf_checkpoint",
    "load_model", "perplexity", "resolve_model", "save_hf_checkpoint",
]
