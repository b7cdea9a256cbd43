"""The ground floor: shared maths every other subpackage may use (linear algebra, spectra and
ranks, Kruskal rank, k-means, bit packing, sharding placement, losses); imports only jax, flax,
optax, numpy and ``pallas_kernels``."""
