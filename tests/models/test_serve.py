"""Adapter serving: PEFT folders in padded slots; hot-swap without recompiling; a batch mixing
two adapters equals each adapter alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.io.peft import export_peft, import_peft
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.serve import AdapterServer
from lowrank_jax.nn import apply_lora, lora_layers

# its module-scoped fixtures are built once: every test of this file runs on one worker
pytestmark = pytest.mark.xdist_group("models.test_serve")

CFG = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=32)
TOKENS = jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, 64)


def base():
    return Llama(CFG, rngs=nnx.Rngs(0))


def adapter(folder, rules, seed, alpha):
    model = base()
    apply_lora(model, [dict(pattern=p, rank=r, alpha=alpha) for p, r in rules.items()],
               rngs=nnx.Rngs(seed))
    for i, (_, layer) in enumerate(lora_layers(model)):
        layer.lora_b[...] = 0.2 * jax.random.normal(jax.random.PRNGKey(seed * 100 + i),
                                                    layer.lora_b[...].shape)
    export_peft(model, folder)
    return folder


def alone(folder, tokens):
    model = base()
    import_peft(model, folder)
    return np.asarray(model(jnp.asarray(tokens))[0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return (adapter(str(root / "a"), {"q_proj": 4, "v_proj": 4}, 1, 8.0),
            adapter(str(root / "b"), {"up_proj": 8, "o_proj": 2}, 2, 16.0),
            adapter(str(root / "c"), {"down_proj": 6}, 3, 3.0))


def test_batch_with_two_adapters_equals_each_alone(folders):
    a, b, _ = folders
    server = AdapterServer(base(), slots=2, max_rank=8)
    server.load(0, a)
    server.load(1, b)
    mixed = np.asarray(server.logits(TOKENS, [0, 1]))
    np.testing.assert_allclose(mixed[0], alone(a, TOKENS[:1])[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mixed[1], alone(b, TOKENS[1:])[0], rtol=1e-4, atol=1e-5)
    swapped = np.asarray(server.logits(TOKENS, [1, 0]))
    np.testing.assert_allclose(swapped[0], alone(b, TOKENS[:1])[0], rtol=1e-4, atol=1e-5)
    assert not np.allclose(mixed[0], swapped[0], atol=1e-3)  # the adapters really differ


def test_hot_swap_does_not_recompile(folders):
    a, b, c = folders
    server = AdapterServer(base(), slots=1, max_rank=8)
    server.load(0, a)
    first = np.asarray(server.logits(TOKENS, [0, 0]))
    assert server.traces == 1
    for folder in (b, c):  # other ranks, alphas and target modules: same compiled function
        server.load(0, folder)
        out = np.asarray(server.logits(TOKENS, [0, 0]))
        np.testing.assert_allclose(out, alone(folder, TOKENS), rtol=1e-4, atol=1e-5)
    assert server.traces == 1
    assert not np.allclose(first, out, atol=1e-3)


def test_rank_above_max_is_a_clear_error(folders):
    server = AdapterServer(base(), slots=1, max_rank=4)
    with pytest.raises(ValueError, match="raise `max_rank` to at least 8"):
        server.load(0, folders[1])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        server.load(0, folders[1] + "-missing")


def alone_tokens(folder, prompt, n, tokenizer=None):
    from lowrank_jax.models.generate import generate

    model = base()
    import_peft(model, folder)
    out = generate(model, tokenizer, prompt, max_new_tokens=n, stop_at_eos=tokenizer is not None)
    return [t for t in out.token_ids if tokenizer is None or t != tokenizer.eos_id]


@pytest.mark.slow
def test_generate_batch_with_two_adapters_equals_each_alone(folders):
    from lowrank_jax.serve import generate_batch

    a, b, _ = folders
    server = AdapterServer(base(), slots=2, max_rank=8)
    server.load(0, a)
    server.load(1, b)
    prompts = [[5, 9, 2], [7, 1, 3, 3, 8, 4]]  # unequal lengths: no padding, exact positions
    for ids, order in (([0, 1], (a, b)), ([1, 0], (b, a))):
        server.set_ids(ids)
        results = generate_batch(server.model, prompts, max_new_tokens=6)
        for result, prompt, folder in zip(results, prompts, order):
            assert result.token_ids == alone_tokens(folder, prompt, 6)


def test_generate_batch_stops_each_example_at_its_eos(folders):
    from lowrank_jax.serve import generate_batch

    server = AdapterServer(base(), slots=1, max_rank=8)
    server.load(0, folders[0])
    server.set_ids([0, 0])
    prompts = [[5, 9, 2], [7, 1]]
    free = generate_batch(server.model, prompts, max_new_tokens=5)
    eos = free[0].token_ids[1]  # the 2nd token of example 0 becomes its end token
    stopped = generate_batch(server.model, prompts, max_new_tokens=5, eos_ids=[eos])
    for one, alone in zip(stopped, free):  # each row ends at its own first end token
        cut = alone.token_ids.index(eos) + 1 if eos in alone.token_ids else 5
        assert one.token_ids == alone.token_ids[:cut]
        assert one.stopped_at_eos == (eos in alone.token_ids)
    assert stopped[0].stopped_at_eos and len(stopped[0].token_ids) <= 2


def test_generate_batch_rejects_empty_prompts():
    from lowrank_jax.serve import generate_batch

    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(base(), [[1, 2], []])


def test_generate_command_serves_two_adapters(folders, monkeypatch, capsys):
    from lowrank_jax.cli import main
    from lowrank_jax.commands import generate as generate_command
    from lowrank_jax.models.tokenizer import ByteTokenizer

    class SmallBytes(ByteTokenizer):  # bytes 0..63 only, as the 64-token test model
        def encode(self, text, **kwargs):
            return [b % 64 for b in super().encode(text, **kwargs)]

    monkeypatch.setattr(generate_command, "load_model_from_args",
                        lambda args: (base(), SmallBytes()))
    a, b, _ = folders
    code = main(["generate", "--model", "x", "--raw", "--max-new-tokens", "3",
                 "--adapter", a, "--prompt", "ab", "--adapter", b, "--prompt", "cd"])
    assert code == 0
    captured = capsys.readouterr()
    assert "one batch" in captured.err
    tok = SmallBytes()
    expected = "".join(f"[adapter {f}]\n{tok.decode(alone_tokens(f, tok.encode(p), 3, tok))}\n"
                       for f, p in ((a, "ab"), (b, "cd")))
    assert captured.out == expected
