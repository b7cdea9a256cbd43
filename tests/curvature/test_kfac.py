"""K-FAC factor estimation: exact per-token Fisher, hand-computed MLP statistics, sampled mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.curvature import kfac
from lowrank_jax.models.llama import Llama, LlamaConfig


class Softmax(nnx.Module):
    def __init__(self, d_in, classes, rngs):
        self.dense = nnx.Linear(d_in, classes, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


class TanhMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(5, 6, use_bias=False, rngs=rngs)
        self.fc2 = nnx.Linear(6, 4, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def test_single_token_kron_equals_exact_fisher():
    model = Softmax(5, 4, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 5))
    y = jnp.array([2])
    f = kfac.estimate_kfac_factors(model, [{"inputs": x, "labels": y}], targets="dense")["dense"]

    def loss(kernel):
        logp = jax.nn.log_softmax(x @ kernel)
        return -logp[0, y[0]]

    g = jax.grad(loss)(model.dense.kernel[...]).reshape(-1)  # C-order vec of [in, out]
    np.testing.assert_allclose(np.kron(f.A, f.G), np.outer(g, g), atol=1e-6)
    assert float(f.n) == 1.0


@pytest.mark.parametrize("use_jit", [True, False])
def test_mlp_factors_match_hand_computation(use_jit):
    model = TanhMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (7, 5))
    y = jax.random.randint(jax.random.key(2), (7,), 0, 4)
    mask = jnp.array([1, 1, 0, 1, 1, 1, 0], jnp.float32)
    batch = {"inputs": x, "labels": y, "mask": mask}

    W1, W2 = model.fc1.kernel[...], model.fc2.kernel[...]
    h = jnp.tanh(x @ W1)
    p = jax.nn.softmax(h @ W2)
    g2 = p - jax.nn.one_hot(y, 4)  # ∂CE/∂logits per token (summed loss)
    g1 = (g2 @ W2.T) * (1 - h**2)
    m = mask[:, None]
    n = mask.sum()
    expected = {
        "fc1": ((x * m).T @ (x * m) / n, (g1 * m).T @ (g1 * m) / n),
        "fc2": ((h * m).T @ (h * m) / n, (g2 * m).T @ (g2 * m) / n),
    }
    paths = ["fc1", "fc2"]
    if use_jit:
        factors = kfac.estimate_kfac_factors(model, [batch], targets=paths)
    else:
        with kfac.tapped_layers(model, paths):
            graphdef, state = nnx.split(model)
            sums = kfac.layer_statistics(graphdef, state, batch, None, paths=paths)
        factors = {k: kfac.KFACFactor(s.A / s.n, s.G / s.n, s.n) for k, s in sums.items()}
    for k, (A, G) in expected.items():
        np.testing.assert_allclose(factors[k].A, A, atol=1e-6)
        np.testing.assert_allclose(factors[k].G, G, atol=1e-6)
    assert type(model.fc1) is nnx.Linear  # taps removed


def test_streaming_equals_one_big_batch():
    model = TanhMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 5))
    y = jax.random.randint(jax.random.key(2), (8,), 0, 4)
    whole = kfac.estimate_kfac_factors(model, [{"inputs": x, "labels": y}], targets="fc")
    parts = kfac.estimate_kfac_factors(
        model, [{"inputs": x[i : i + 2], "labels": y[i : i + 2]} for i in range(0, 8, 2)],
        targets="fc",
    )
    for k in whole:
        np.testing.assert_allclose(parts[k].A, whole[k].A, atol=1e-6)
        np.testing.assert_allclose(parts[k].G, whole[k].G, atol=1e-6)
    combined = kfac.combine_factors([parts, whole])
    np.testing.assert_allclose(combined["fc1"].A, whole["fc1"].A, atol=1e-6)


def test_sampled_fisher_approaches_gauss_newton_output_factor():
    model = Softmax(3, 4, nnx.Rngs(0))
    x = jnp.tile(jnp.array([[0.5, -1.0, 2.0]]), (4000, 1))
    batch = {"inputs": x, "labels": jnp.zeros((4000,), jnp.int32)}
    f = kfac.estimate_kfac_factors(
        model, [batch], targets="dense", fisher="sampled", rng=jax.random.key(3)
    )["dense"]
    p = jax.nn.softmax(x[0] @ model.dense.kernel[...])
    np.testing.assert_allclose(f.G, jnp.diag(p) - jnp.outer(p, p), atol=0.02)
    np.testing.assert_allclose(f.A, jnp.outer(x[0], x[0]), atol=1e-5)


def test_bregman_hessian_is_gauss_newton():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (6, 3), jnp.float64)
        for seed in (1, 2):  # two base points, neither a minimiser of anything
            W0 = jax.random.normal(jax.random.key(seed), (3, 4), jnp.float64)

            def kl(W):
                lp0 = jax.nn.log_softmax(x @ W0)
                lp = jax.nn.log_softmax(x @ W)
                return jnp.mean(jnp.sum(jnp.exp(lp0) * (lp0 - lp), -1))

            H = jax.hessian(kl)(W0).reshape(12, 12)
            p = jax.nn.softmax(x @ W0)
            out_h = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]  # diag p − ppᵀ
            # J_t = ∂z_t/∂vec(W) = x_t ⊗ I, so Jᵀ H_out J = x xᵀ ⊗ H_out, averaged over t
            gnh = jnp.einsum("ti,tj,tkl->ikjl", x, x, out_h).reshape(12, 12) / 6
            np.testing.assert_allclose(H, gnh, atol=1e-8)


def test_llama_layers_and_errors():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=24)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 32)
    f = kfac.estimate_kfac_factors(model, [kfac.lm_batch(tokens)], targets=r"mlp/down_proj")
    assert sorted(f) == ["layers/0/mlp/down_proj", "layers/1/mlp/down_proj"]
    assert f["layers/1/mlp/down_proj"].A.shape == (24, 24)
    assert f["layers/1/mlp/down_proj"].G.shape == (16, 16)
    assert float(f["layers/0/mlp/down_proj"].n) == 16.0
    evals = jnp.linalg.eigvalsh(f["layers/0/mlp/down_proj"].G)
    assert float(evals.min()) > -1e-6  # PSD
    with pytest.raises(ValueError, match="available dense layers: layers/0/mlp/down_proj"):
        kfac.estimate_kfac_factors(model, [kfac.lm_batch(tokens)], targets="no_such_layer")
    with pytest.raises(ValueError, match="fisher="):
        kfac.estimate_kfac_factors(model, [kfac.lm_batch(tokens)], targets="down", fisher="x")
    with pytest.raises(ValueError, match="rng"):
        kfac.estimate_kfac_factors(model, [kfac.lm_batch(tokens)], targets="down",
                                   fisher="sampled")


def test_padding_is_masked():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=24)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.array([[5, 6, 7, 8, 0, 0]])
    f = kfac.estimate_kfac_factors(model, [kfac.lm_batch(tokens, pad_id=0)], targets="down")
    assert float(f["layers/0/mlp/down_proj"].n) == 3.0
