"""LoKRA / LoKRA+: Kruskal-rank facts, penalty properties, Khatri-Rao adapter invariants."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.nn import LoRALinear
from lowrank_jax.nn.lokra import (
    LoKRAPlusLinear,
    coherence,
    khatri_rao,
    kruskal_penalty,
    kruskal_rank_exact,
    lokra_regularizer,
)


def test_kruskal_rank_known_cases():
    assert kruskal_rank_exact(np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])) == 1
    assert kruskal_rank_exact(np.eye(4)) == 4
    rng = np.random.default_rng(0)
    m = rng.normal(size=(3, 7))
    assert kruskal_rank_exact(m) == 3 <= np.linalg.matrix_rank(m)


def test_khatri_rao_bound_holds():
    rng = np.random.default_rng(1)
    for trial in range(30):
        p = rng.normal(size=(2, 5))
        q = rng.normal(size=(3, 5))
        if trial % 3 == 0:
            p[:, 1] = p[:, 0]  # rank-deficient / duplicated columns
        kp, kq = kruskal_rank_exact(p), kruskal_rank_exact(q)
        kr = kruskal_rank_exact(np.asarray(khatri_rao(jnp.asarray(p), jnp.asarray(q))))
        assert kr >= min(kp + kq - 1, 5)


def test_frame_penalty_properties():
    tight = jnp.concatenate([jnp.eye(3), jnp.eye(3)], axis=1)
    assert abs(float(kruskal_penalty(tight))) < 1e-6
    m = jax.random.normal(jax.random.key(0), (3, 9))
    value = float(kruskal_penalty(m))
    assert value >= 0
    scaled = m * jnp.arange(1.0, 10.0)[None, :]
    np.testing.assert_allclose(float(kruskal_penalty(scaled)), value, rtol=1e-5)
    with_zero = m.at[:, 0].set(0.0)
    grad = jax.jit(jax.grad(kruskal_penalty))(with_zero)
    assert np.isfinite(np.asarray(grad)).all()
    assert float(kruskal_penalty(jnp.zeros((3, 9)))) == 0.0


def test_penalty_descent_lowers_coherence_and_separates_duplicates():
    m = jax.random.normal(jax.random.key(1), (4, 8))
    m = m.at[:, 1].set(m[:, 0] + 0.05 * jax.random.normal(jax.random.key(2), (4,)))
    mu0 = float(coherence(m))
    for kind, lr in (("frame", 2.0), ("coherence", 0.2)):
        x = m
        grad_fn = jax.jit(jax.grad(lambda x: kruskal_penalty(x, kind=kind)))
        for _ in range(200):
            x = x - lr * grad_fn(x)
        assert float(coherence(x)) < mu0
        assert kruskal_rank_exact(np.asarray(x), rtol=0.1) > kruskal_rank_exact(np.asarray(m),
                                                                               rtol=0.1)


def test_lokra_plus_zero_init_shapes_and_rank():
    dense = nnx.Linear(10, 7, rngs=nnx.Rngs(0))
    layer = LoKRAPlusLinear.from_linear(dense, rank1=2, rank2=3, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (4, 10))
    np.testing.assert_array_equal(layer(x), dense(x))
    a, b = layer.lora_factors()
    assert a.shape == (10, 6) and b.shape == (6, 7)
    layer.lora_b2[...] = jax.random.normal(jax.random.key(3), (3, 7))
    assert np.linalg.matrix_rank(np.asarray(layer.delta()), tol=1e-5) <= 6
    np.testing.assert_allclose(layer(x), dense(x) + x @ layer.delta(), atol=1e-5)


def test_kruskal_tools_are_the_analysis_ones():
    from lowrank_jax import analysis

    assert kruskal_rank_exact is analysis.kruskal_rank_exact
    assert kruskal_penalty is analysis.kruskal_penalty
    assert khatri_rao is analysis.khatri_rao and coherence is analysis.coherence


class _Net(nnx.Module):
    def __init__(self):
        self.a = LoRALinear(4, 2, rank=2, rngs=nnx.Rngs(0))
        self.b = LoKRAPlusLinear(6, 5, rank1=2, rank2=2, rngs=nnx.Rngs(1))


def test_regularizer_has_the_known_value_of_each_adapter():
    net = _Net()
    # LoRA layer: lora_aᵀ = [I₂ I₂] is a tight frame (penalty 0); lora_b has two identical
    # channels e₀, e₀ in R²: unit Gram e₀e₀ᵀ·2, ‖·‖²/n² − 1/p = 4/4 − 1/2 = 0.5.
    net.a.lora_a[...] = jnp.concatenate([jnp.eye(2), jnp.eye(2)], axis=0)
    net.a.lora_b[...] = jnp.array([[1.0, 1.0], [0.0, 0.0]])
    # LoKRA+ layer: B2 = 0 at init, so its penalty is 0 and the layer adds the three others.
    lokra_terms = (kruskal_penalty(net.b.lora_a1[...].T) + kruskal_penalty(net.b.lora_a2[...].T)
                   + kruskal_penalty(net.b.lora_b1[...]))
    assert float(lokra_terms) > 0.05  # random factors are not tight frames
    np.testing.assert_allclose(float(net.b.regularizer()), float(lokra_terms), rtol=1e-6)
    want = (0.5 + float(lokra_terms)) / 2
    np.testing.assert_allclose(float(lokra_regularizer(net)), want, rtol=1e-5)
    np.testing.assert_allclose(float(lokra_regularizer(net, normalize=False)), 2 * want,
                               rtol=1e-5)


def test_regularizer_gradient_separates_duplicate_channels():
    net = _Net()
    net.a.lora_b[...] = jnp.array([[1.0, 0.9], [0.0, 0.1]])  # two near-duplicate channels
    before = float(coherence(net.a.lora_b[...]))
    grad_fn = nnx.jit(nnx.grad(lambda m: lokra_regularizer(m),
                               argnums=nnx.DiffState(0, nnx.LoRAParam)))
    for _ in range(50):
        grads = grad_fn(net)
        assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
        net.a.lora_b[...] = net.a.lora_b[...] - 0.5 * grads["a"]["lora_b"][...]
    assert float(coherence(net.a.lora_b[...])) < before - 0.3
