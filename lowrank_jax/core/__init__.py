"""The ground floor: maths every other package builds on (imports only jax/flax/optax/numpy)."""
