"""lowrank_jax: low-rank methods for LLMs as composable JAX / Flax NNX / optax pieces."""

__version__ = "0.1.0"

__all__ = ["__version__"]
