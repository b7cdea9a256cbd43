"""Adapter serving: PEFT folders in padded slots; hot-swap without recompiling; a batch mixing
two adapters equals each adapter alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowrank_jax.io.peft import export_peft, import_peft
from lowrank_jax.models.llama import Llama, LlamaConfig
from lowrank_jax.models.serve import AdapterServer
from lowrank_jax.nn import apply_lora, lora_layers

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
    with pytest.raises(ValueError, match="raise --max-rank to at least 8"):
        server.load(0, folders[1])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        server.load(0, folders[1] + "-missing")


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
    out = capsys.readouterr().out
    assert f"[adapter {a}]" in out and f"[adapter {b}]" in out
