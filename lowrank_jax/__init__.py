"""lowrank_jax: low-rank methods for LLMs as composable JAX / Flax NNX / optax pieces."""

#: The package version (also in pyproject.toml).
__version__ = "0.1.0"

__all__ = ["__version__"]
