"""SALE on a model's own attention inputs: a dense head (τ = 0) matches dense attention exactly
and computes every causal block; a sparse head skips blocks."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowrank_jax.kv.model import attention_inputs
from lowrank_jax.kv.sale import sale_vs_dense
from lowrank_jax.models import Llama, LlamaConfig
from lowrank_jax.models.generate import perplexity
from pallas_kernels.sparse_attention.reference import SaleConfig


def test_sale_vs_dense_per_layer_and_whole_model():
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32,
                      max_seq_len=128)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, 32, 128).astype(np.int32)
    sale = SaleConfig(block_q=16, block_k=16, block_seg=16, local_window=16, dense_below=0)
    taus = np.array([[0.0, 0.0], [0.5, 0.5]], np.float32)  # layer 0 dense, layer 1 sparse
    qkv = attention_inputs(model, jnp.asarray(ids[None]))
    per_layer, nll = sale_vs_dense(model, ids, qkv, taus, sale)
    assert per_layer[0]["rel_err"] < 1e-5 and per_layer[0]["density"] == 1.0
    assert per_layer[1]["density"] < 1.0 and per_layer[1]["rel_err"] > 0
    dense = perplexity(model, ids, window=len(ids), progress=False).nll
    assert np.isfinite(nll) and abs(nll - dense) < 0.5
