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


def test_a_factorized_layer_costs_two_r_times_in_plus_out_per_token():
    """Hand count 2·r·(d_in + d_out) per token, and XLA's own count of the jitted layer."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lowrank_jax.nn.factorized import FactorizedLinear

    d_in, d_out, rank, tokens = 48, 80, 6, 10
    layer = FactorizedLinear(d_in, d_out, rank, rngs=nnx.Rngs(0))
    hand = tokens * 2 * rank * (d_in + d_out)  # x @ A: 2·T·d_in·r, then @ B: 2·T·r·d_out
    assert hand == 15360 and hand < tokens * 2 * d_in * d_out  # the dense matrix: 76800
    x = jnp.ones((tokens, d_in))
    cost = jax.jit(lambda x: layer(x)).lower(x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost["flops"] == hand
    # the model counter charges the same per projection
    cfg = _cfg(n_layers=1, projection="factorized", rank_ratio=0.25)
    per_token = sum(2 * cfg.rank_for(m, n) * (m + n) for m, n in
                    [(16, 16), (16, 8), (16, 8), (16, 16), (16, 32), (16, 32), (32, 16)])
    assert 2 * matmul_params(cfg) == per_token + 2 * 16 * 100


def test_training_flops_count_the_query_width_not_d_model():
    cfg = _cfg(head_dim=8)  # 4 heads x 8 = 32 wide queries on a 16-wide model
    seq = 8
    assert training_flops_per_token(cfg, seq) == 6 * matmul_params(cfg) + 6 * 2 * 32 * seq
    assert training_flops_per_token(cfg, seq) == 3 * forward_flops(cfg, seq, causal=True) / seq


def test_the_chip_table_names_devices_and_gives_mfu():
    from lowrank_jax.models.flops import CHIPS, chip_for_device_kind, mfu, peak_flops

    peaks = {key: spec.peak_flops / 1e12 for key, spec in CHIPS.items()}
    assert {k: peaks[k] for k in ("v5e", "v5p", "v6e", "h100", "h200")} == {
        "v5e": 197, "v5p": 459, "v6e": 918, "h100": 989, "h200": 989}
    assert [CHIPS[k].hbm_bytes / 2**30 for k in ("v5e", "v5p", "v6e")] == [16, 95, 32]
    kinds = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v4": "v4",
             "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "cpu": None}
    assert {kind: chip_for_device_kind(kind) for kind in kinds} == kinds
    assert peak_flops("cpu") is None and mfu(1.0, 1.0, None) is None
    assert peak_flops("cpu", 2.0) == 2e12
    # 6·N FLOPs per token, N = 1e9, at 16,417 tokens/s on a v5e: half the chip's peak
    assert abs(mfu(6e9, 197e12 / 6e9 / 2, peak_flops("TPU v5 lite")) - 0.5) < 1e-12
