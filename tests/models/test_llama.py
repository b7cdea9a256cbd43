"""The Llama decoder with a KV cache: cached decoding equals full recomputation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.models.generate import generate, logits_full, perplexity
from lowrank_jax.models.llama import KVCache, Llama, LlamaConfig, apply_rope

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("models.test_llama")


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                max_seq_len=64)
    base.update(overrides)
    return LlamaConfig(**base)


@pytest.fixture(scope="module")
def model():
    return Llama(tiny_config(), rngs=nnx.Rngs(0))


# Whole-model jit: one compilation per shape instead of one per primitive in eager mode.
call = nnx.jit(lambda model, tokens: model(tokens)[0])
call_cached = nnx.jit(lambda model, tokens, cache: model(tokens, cache=cache))


def test_gqa_shapes(model):
    cfg = model.cfg
    x = jnp.ones((2, 5, cfg.d_model))
    q, k, v = model.layers[0].self_attn.qkv(x)
    assert q.shape == (2, 5, 4, 8)
    assert k.shape == v.shape == (2, 5, 2, 8)
    cache = KVCache.empty(cfg, batch=2, max_len=16)
    assert cache.keys.shape == (2, 2, 16, 2, 8)
    logits, cache = call_cached(model, jnp.zeros((2, 5), jnp.int32), cache)
    assert logits.shape == (2, 5, cfg.vocab_size)
    assert int(cache.length) == 5


def test_cached_decode_equals_full_recomputation(model):
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, model.cfg.vocab_size)
    full = call(model, tokens)
    cache = KVCache.empty(model.cfg, batch=2, max_len=12)
    logits, cache = call_cached(model, tokens[:, :5], cache)  # prefill 5
    pieces = [logits]
    for t in range(5, 9):  # then one token at a time
        step, cache = call_cached(model, tokens[:, t : t + 1], cache)
        pieces.append(step)
    cached = jnp.concatenate(pieces, axis=1)
    np.testing.assert_allclose(cached, full, atol=1e-4, rtol=0)
    assert float(jnp.max(jnp.abs(cached - full))) < 1e-4


def test_scanned_forward_matches_model_call(model):
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, model.cfg.vocab_size)
    reference = call(model, tokens)
    np.testing.assert_allclose(logits_full(model, tokens), reference, atol=1e-5)
    np.testing.assert_allclose(logits_full(model, tokens, scan_layers=False), reference,
                               atol=1e-5)


PROMPT = [3, 14, 15, 9, 26]  # one prompt length and one budget: the tests share compilations


def test_generate_logits_equal_full_recomputation(model):
    prompt = PROMPT
    out = generate(model, None, prompt, max_new_tokens=6, return_logits=True)
    assert len(out.token_ids) == 6
    sequence = jnp.asarray([prompt + out.token_ids])
    full = call(model, sequence)
    # the logits that chose new token i sit at position len(prompt) - 1 + i
    expected = np.asarray(full[0, len(prompt) - 1 : len(prompt) - 1 + 6])
    assert np.max(np.abs(out.logits - expected)) < 1e-4
    assert out.token_ids == [int(i) for i in np.argmax(expected, axis=-1)]  # greedy


def test_generate_stops_at_eos_and_streams(model):
    greedy = generate(model, None, PROMPT, max_new_tokens=6, stop_at_eos=False).token_ids
    streamed = []
    out = generate(model, None, PROMPT, max_new_tokens=6, eos_ids=[greedy[2]],
                   stream=lambda token, text: streamed.append(token))
    stop = greedy.index(greedy[2]) + 1
    assert out.token_ids == greedy[:stop] and out.stopped_at_eos and streamed == greedy[:stop]


def test_top_p_sampling_is_seeded_and_in_vocab(model):
    kwargs = dict(max_new_tokens=6, temperature=1.0, top_p=0.9)
    a = generate(model, None, PROMPT, key=jax.random.key(7), **kwargs).token_ids
    b = generate(model, None, PROMPT, key=jax.random.key(7), **kwargs).token_ids
    assert a == b and all(0 <= t < model.cfg.vocab_size for t in a)
    # a tiny nucleus keeps only the top token: sampling equals greedy
    greedy = generate(model, None, PROMPT, max_new_tokens=6).token_ids
    nucleus = generate(model, None, PROMPT, max_new_tokens=6, temperature=1.0, top_p=1e-6,
                       key=jax.random.key(0)).token_ids
    assert nucleus == greedy


def test_perplexity_windows_match_direct_nll(model):
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (30,), 0, model.cfg.vocab_size))
    result = perplexity(model, tokens, window=20, stride=10, progress=False)

    def target_nll(window_tokens):  # -log p(x_r | x_<r) for r = 1 .. len-1 inside a window
        logits = call(model, jnp.asarray(window_tokens[None]))
        logp = jax.nn.log_softmax(logits[0, :-1])
        return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(window_tokens[1:, None]), 1))[:, 0]

    # window [0, 20) scores tokens 1..19; window [10, 30) scores 20..29 with 10 tokens of context
    expected = np.concatenate([target_nll(tokens[:20]), target_nll(tokens[10:30])[9:]])
    assert result.n_tokens == 29 == expected.size and result.n_windows == 2
    np.testing.assert_allclose(result.nll, expected.mean(), rtol=1e-5)


def test_prompt_longer_than_context_is_a_clear_error(model):
    with pytest.raises(ValueError, match="context is 64"):
        generate(model, None, list(range(64)), max_new_tokens=2)


def test_lora_models_run_through_the_scanned_and_full_paths():
    from lowrank_jax.models.generate import prepare
    from lowrank_jax.nn import LoRARule, apply_lora, lora_layers

    model = Llama(tiny_config(), rngs=nnx.Rngs(5))
    tokens = jnp.asarray([PROMPT])
    base = call(model, tokens)

    def nonzero_b(seed):  # B = 0 would make an ignored adapter pass; give every B values
        for i, (_, layer) in enumerate(lora_layers(model)):
            shape = layer.lora_b[...].shape
            layer.lora_b[...] = 0.3 * jax.random.normal(jax.random.key(seed + i), shape)

    apply_lora(model, LoRARule("q_proj|v_proj", rank=2), rngs=nnx.Rngs(1))
    nonzero_b(10)
    with_adapters = call(model, tokens)
    assert float(jnp.max(jnp.abs(with_adapters - base))) > 1e-3  # the adapters matter
    assert prepare(model)[0].mode == "scan"  # every layer has the same adapters
    np.testing.assert_allclose(logits_full(model, tokens), with_adapters, atol=1e-5)
    apply_lora(model, LoRARule("layers/0/mlp/up_proj", rank=2), rngs=nnx.Rngs(2))
    nonzero_b(20)
    with_more = call(model, tokens)
    assert float(jnp.max(jnp.abs(with_more - with_adapters))) > 1e-3
    assert prepare(model)[0].mode == "full"  # layers differ: the model's own loop
    np.testing.assert_allclose(logits_full(model, tokens), with_more, atol=1e-5)


def test_per_layer_attention_names_are_used_per_layer():
    from lowrank_jax.attention import register_attention

    register_attention("zero_for_test", lambda q, k, v, **_: jnp.zeros_like(q))
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
                      attention=["reference", "zero_for_test"])  # a list is accepted (YAML)
    assert cfg.attention == ("reference", "zero_for_test")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 7)), jnp.int32)
    logits, _ = model(tokens)
    # by hand: layer 0 exact, layer 1's attention adds o_proj(0) = 0, then its MLP
    positions = jnp.broadcast_to(jnp.arange(7)[None], (2, 7))
    x, _ = model.layers[0](model.embed_tokens(tokens), positions)
    layer = model.layers[1]
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    np.testing.assert_allclose(logits, model.logits_from_hidden(model.norm(x)), atol=1e-5)
    # the jitted runners fall back from the layer scan and agree with the model call
    np.testing.assert_allclose(logits_full(model, tokens), logits, atol=1e-5)
    with pytest.raises(ValueError, match="per-layer names"):
        LlamaConfig(n_layers=3, attention=("reference", "reference"))


def test_apply_rope_is_the_kernels_rope_and_rotates_pairs():
    """The model's RoPE is ``pallas_kernels.rope.rope`` (one RoPE in the package), in x's dtype."""
    from pallas_kernels.rope import rope

    x = jnp.array([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])  # b=2, t=1, h=1, d=2
    positions = jnp.array([[1], [2]])
    got = apply_rope(x, positions, 1e4)
    # the pair (x_i, x_{i+D/2}) rotates by angle p * theta^0 = p
    np.testing.assert_allclose(got[0, 0, 0], [np.cos(1.0), np.sin(1.0)], rtol=1e-6)
    np.testing.assert_allclose(got[1, 0, 0], [-np.sin(2.0), np.cos(2.0)], rtol=1e-6)
    np.testing.assert_array_equal(got, rope(x, positions, 1e4))
    assert apply_rope(x.astype(jnp.bfloat16), positions, 1e4).dtype == jnp.bfloat16
