"""generate's compiled decode loop (one lax.while_loop) gives the tokens of the per-token loop."""

import jax
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.generate import generate
from lowrank_jax.models.llama import Llama, LlamaConfig

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("models.test_decode_loop")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                      max_seq_len=64)
    return Llama(cfg, rngs=nnx.Rngs(0))


def stepwise(model, **kwargs):
    """The per-token path: a stream callback forces one jitted step per token from Python."""
    return generate(model, None, PROMPT, stream=lambda token, text: None, **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=7),
    dict(max_new_tokens=7, temperature=0.9, top_p=0.8, key=jax.random.key(3)),
])
def test_compiled_loop_equals_stepwise_tokens_and_logits(model, kwargs):
    fast = generate(model, None, PROMPT, return_logits=True, stop_at_eos=False, **kwargs)
    slow = stepwise(model, return_logits=True, stop_at_eos=False, **kwargs)
    assert fast.token_ids == slow.token_ids and len(fast.token_ids) == 7
    np.testing.assert_allclose(fast.logits, slow.logits, rtol=1e-5, atol=1e-5)
    assert not fast.stopped_at_eos


def test_compiled_loop_stops_at_eos_like_stepwise(model):
    greedy = generate(model, None, PROMPT, max_new_tokens=6, stop_at_eos=False).token_ids
    eos = greedy[3]
    first = greedy.index(eos)
    fast = generate(model, None, PROMPT, max_new_tokens=6, eos_ids=[eos])
    slow = stepwise(model, max_new_tokens=6, eos_ids=[eos])
    assert fast.token_ids == slow.token_ids == greedy[:first + 1]
    assert fast.stopped_at_eos and slow.stopped_at_eos
    ignored = generate(model, None, PROMPT, max_new_tokens=6, eos_ids=[eos], stop_at_eos=False)
    assert ignored.token_ids == greedy and not ignored.stopped_at_eos


@pytest.mark.parametrize("preset", ["model", "tiny"])
def test_unrolled_decode_equals_scanned_decode(model, preset):
    """The unrolled decode (weights read in place) gives the tokens and logits of the scanned
    decode, on this model and on the ``tiny`` preset."""
    from lowrank_jax.models.presets import preset_model

    m = model if preset == "model" else preset_model("tiny")
    prompt = PROMPT if preset == "model" else [72, 101, 108, 108, 111, 32]
    fast = generate(m, None, prompt, max_new_tokens=9, return_logits=True, stop_at_eos=False,
                    unroll_decode=True)
    slow = generate(m, None, prompt, max_new_tokens=9, return_logits=True, stop_at_eos=False,
                    unroll_decode=False)
    assert fast.token_ids == slow.token_ids and len(fast.token_ids) == 9
    np.testing.assert_allclose(fast.logits, slow.logits, rtol=1e-5, atol=1e-5)


def test_kv_cache_advance_writes_the_new_positions_only(model):
    """Two cached calls (prefill 5, then 3 tokens) fill the cache with a full forward's keys:
    positions beyond the filled length stay zero, the filled ones match one pass over 8."""
    import jax.numpy as jnp

    from lowrank_jax.models.llama import KVCache

    tokens = jnp.asarray([PROMPT], jnp.int32)
    cache = KVCache.empty(model.cfg, 1, 12)
    full_logits, full = model(tokens, cache=cache)
    _, part = model(tokens[:, :5], cache=cache)
    logits, part = model(tokens[:, 5:], cache=part)
    assert int(part.length) == int(full.length) == 8
    np.testing.assert_allclose(part.keys, full.keys, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(part.values, full.values, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(part.keys[:, :, 8:]).max()) == 0.0
    assert bool(jnp.all(jnp.abs(full.keys[:, :, :8]).sum(axis=(0, 1, 3, 4)) > 0))
    np.testing.assert_allclose(logits, full_logits[:, 5:], rtol=1e-4, atol=1e-5)


def test_decode_unrolls_only_for_long_generations(monkeypatch):
    """``unroll_decode=None`` unrolls from ``UNROLL_MIN_NEW_TOKENS`` new tokens on (the unrolled
    step compiles slower, so short answers keep the scanned one)."""
    import importlib

    from lowrank_jax.models.presets import preset_model

    gen_mod = importlib.import_module("lowrank_jax.models.generate")

    tiny = preset_model("tiny")
    calls = []
    real = gen_mod.prepare
    monkeypatch.setattr(gen_mod, "prepare", lambda m, **kw: calls.append(kw) or real(m, **kw))
    monkeypatch.setattr(gen_mod, "UNROLL_MIN_NEW_TOKENS", 4)
    gen_mod.generate(tiny, None, [72, 101], max_new_tokens=3, stop_at_eos=False)
    assert {"scan_layers": False} not in calls
    gen_mod.generate(tiny, None, [72, 101], max_new_tokens=4, stop_at_eos=False)
    assert calls[-1] == {"scan_layers": False}
