"""Packed LoRA jobs train exactly like the same jobs run one after another (bench.packed)."""

import numpy as np
from flax import nnx

from lowrank_jax.bench.packed import packed_lora_jobs, sequential_lora_jobs
from lowrank_jax.models.llama import Llama, LlamaConfig


def test_packed_jobs_losses_equal_the_sequential_ones():
    cfg = LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                      max_seq_len=8)
    base_fn = lambda: Llama(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    tokens = np.arange(512) * 7 % 64
    jobs = dict(ranks=(2, 4), lrs=(1e-2, 3e-2), batch=2, seq_len=8, steps=3)
    done = []
    seconds, losses, inits = sequential_lora_jobs(base_fn, tokens, **jobs, on_job=done.append)
    assert done == [0, 1] and seconds > 0 and [len(x) for x in losses] == [3, 3]
    assert inits[0]["layers/0/mlp/up_proj"][0].shape == (16, 2)
    assert np.all(np.isfinite(losses)) and losses[0] != losses[1]  # two different jobs
    packed_s, packed = packed_lora_jobs(base_fn, tokens, **jobs, inits=inits,
                                        implementation="gather")
    np.testing.assert_allclose(packed, losses, rtol=1e-5)
