"""LoRA initialisations: initial output unchanged, and each method's own invariant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.nn import LoRALinear
from lowrank_jax.nn.init import capture_layer_inputs, gap_direction, init_lora, init_lora_model

X = jax.random.normal(jax.random.key(7), (6, 12))


def _layer(rank=3, alpha=6.0):
    return LoRALinear(12, 10, rank=rank, alpha=alpha, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("method", ["standard", "peft", "gaussian", "pissa", "olora", "gap"])
def test_initial_output_unchanged(method):
    layer = _layer()
    before = layer(X)
    init_lora(layer, method, key=jax.random.key(1), calibration_inputs=X)
    np.testing.assert_allclose(layer(X), before, atol=2e-5, rtol=1e-5)


def test_peft_init_is_torch_kaiming_uniform_a_sqrt5():
    """PEFT's A init: kaiming_uniform_(a=√5) on [r, in] = U(±1/√in); B = 0."""
    layer = LoRALinear(300, 64, rank=64, rngs=nnx.Rngs(0))
    init_lora(layer, "peft", key=jax.random.key(2))
    a = np.asarray(layer.lora_a[...])
    bound = 1 / np.sqrt(300)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.99 * bound
    np.testing.assert_allclose(a.var(), bound**2 / 3, rtol=0.05)  # variance of U(±b)
    np.testing.assert_array_equal(layer.lora_b[...], 0.0)
    init_lora(layer, "standard", key=jax.random.key(2))  # he_uniform: √6 wider
    assert np.abs(layer.lora_a[...]).max() > 2.0 * bound


def test_pissa_adapter_holds_top_singular_directions():
    layer = _layer()
    w = layer.kernel[...]
    init_lora(layer, "pissa")
    sigma = jnp.linalg.svd(w, compute_uv=False)
    got = jnp.linalg.svd(layer.delta(), compute_uv=False)[:3]
    np.testing.assert_allclose(got, sigma[:3], rtol=1e-4)


def test_olora_right_factor_orthonormal():
    layer = _layer()
    init_lora(layer, "olora")
    b = layer.lora_b[...]
    np.testing.assert_allclose(b @ b.T, jnp.eye(3), atol=1e-5)


def test_gap_zero_update_unit_aligned_rows_and_gradients():
    layer = _layer(rank=3)
    shift = jnp.zeros(12).at[0].set(5.0)
    init_lora(layer, "gap", calibration_inputs=X + shift, key=jax.random.key(2))
    a, b = layer.lora_a[...], layer.lora_b[...]
    np.testing.assert_array_equal(a, 0.0)
    np.testing.assert_allclose(b @ b.T, jnp.eye(3), atol=1e-5)  # extra rows non-zero
    expected = gap_direction(layer.kernel[...], X + shift)
    assert float(jnp.dot(b[0], expected)) > 0.999
    target = jax.random.normal(jax.random.key(3), (6, 10))

    def loss(a, b):
        out = X @ layer.kernel[...] + layer.scaling * (X @ a) @ b
        return 0.5 * jnp.sum((out - target) ** 2)

    grad_a, grad_b = jax.grad(loss, argnums=(0, 1))(a, b)
    np.testing.assert_array_equal(grad_b, 0.0)
    g = X @ layer.kernel[...] - target  # dL/dh
    np.testing.assert_allclose(grad_a, layer.scaling * X.T @ g @ b.T, atol=1e-4)


def test_gap_noise_lowers_alignment():
    g = jnp.zeros(10).at[2].set(1.0)
    cosines = []
    for sigma in (0.0, 0.2, 1.0):
        layer = _layer(rank=1)
        init_lora(layer, "gap", gap_vector=g, noise=sigma, key=jax.random.key(4))
        cosines.append(float(layer.lora_b[0] @ g))
    assert cosines[0] > 0.999 and cosines[0] > cosines[1] > cosines[2]


def test_gap_direction_finds_offset_and_is_permutation_invariant():
    k1, k2 = jax.random.split(jax.random.key(5))
    offset = jnp.zeros(16).at[3].set(1.0)
    text = jax.random.normal(k1, (256, 16)) + 3 * offset
    ref = jax.random.normal(k2, (256, 16))
    g = gap_direction(jnp.eye(16), text, ref)
    assert float(g @ offset) > 0.95
    g_perm = gap_direction(jnp.eye(16), text[::-1], ref)
    np.testing.assert_allclose(g, g_perm, atol=1e-6)


def test_model_level_gap_uses_captured_inputs():
    class Net(nnx.Module):
        def __init__(self):
            self.up = LoRALinear(12, 10, rank=2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.up(x)

    net = Net()
    before = net(X)
    captured = capture_layer_inputs(net, lambda m: m(X))
    np.testing.assert_array_equal(captured["up"], X)
    assert init_lora_model(net, "gap", calibration_forward=lambda m: m(X + 1.0)) == ["up"]
    np.testing.assert_array_equal(net(X), before)
    assert isinstance(net.up, LoRALinear)


@pytest.mark.no_typecheck  # checks our own ValueError, which a type check would pre-empt
def test_bad_inputs():
    with pytest.raises(ValueError, match="method"):
        init_lora(_layer(), "eva")
    with pytest.raises(ValueError, match="calibration_inputs"):
        init_lora(_layer(), "gap")
    with pytest.raises(ValueError, match="12 input"):
        init_lora(_layer(), "gap", calibration_inputs=jnp.ones((4, 5)))


def test_peft_lora_state_draws_each_a_from_its_own_split_key():
    """Known answer: A leaf i (tree order) is U(±1/√in) from split(key, 64)[i]; B leaves zero."""
    from lowrank_jax.nn.init import peft_lora_state

    tree = {"p": {"lora_a": jnp.ones((4, 2)), "lora_b": jnp.ones((2, 3))},
            "q": {"lora_a": jnp.ones((9, 2)), "lora_b": jnp.ones((2, 5))}}
    out = peft_lora_state(tree, jax.random.key(3))
    keys = jax.random.split(jax.random.key(3), 64)
    np.testing.assert_array_equal(out["p"]["lora_a"],
                                  jax.random.uniform(keys[0], (4, 2), minval=-0.5, maxval=0.5))
    np.testing.assert_array_equal(out["q"]["lora_a"],
                                  jax.random.uniform(keys[1], (9, 2), minval=-1 / 3, maxval=1 / 3))
    assert float(jnp.abs(out["p"]["lora_b"]).sum() + jnp.abs(out["q"]["lora_b"]).sum()) == 0.0
