"""The one FLOP counter of a LlamaConfig against hand-counted matmul work."""

from lowrank_jax.models import LlamaConfig
from lowrank_jax.models.flops import forward_flops, matmul_params, training_flops_per_token


def _cfg(**kw):
    base = dict(vocab_size=100, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    return LlamaConfig(**{**base, **kw})


def test_dense_counts_match_the_shapes_by_hand():
    cfg = _cfg()  # head_dim 4: q, o 16x16; k, v 16x8; gate, up, down 16x32
    per_layer = 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 32
    assert matmul_params(cfg) == 2 * per_layer + 16 * 100
    tokens = 5
    full = 2 * tokens * matmul_params(cfg) + 4 * 2 * 4 * 4 * tokens**2
    assert forward_flops(cfg, tokens) == full
    assert forward_flops(cfg, tokens, causal=True) == full - 4 * 2 * 4 * 4 * tokens**2 / 2


def test_training_is_three_causal_forwards_per_token_when_heads_fill_the_width():
    cfg = _cfg()  # n_heads * head_dim == d_model
    seq = 8
    assert training_flops_per_token(cfg, seq) == 3 * forward_flops(cfg, seq, causal=True) / seq


def test_factorized_projections_count_their_factors():
    cfg = _cfg(projection="factorized", rank_ratio=0.25)
    ranks = [cfg.rank_for(m, n) for m, n in [(16, 16), (16, 8), (16, 8), (16, 16), (16, 32),
                                               (16, 32), (32, 16)]]
    assert ranks == [4, 2, 2, 4, 4, 4, 4]
    per_layer = 4 * 32 + 2 * 2 * 24 + 4 * 32 + 3 * 4 * 48
    assert matmul_params(cfg) == 2 * per_layer + 1600
