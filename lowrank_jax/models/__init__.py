"""Models: the Llama-style decoder (and, later, real-checkpoint loaders)."""

from lowrank_jax.models.llama import KVCache, Llama, LlamaConfig, count_params

__all__ = ["KVCache", "Llama", "LlamaConfig", "count_params"]
