"""Chat templates of the checkpoint families: read from tokenizer_config.json, rendered as
transformers renders them, used by ``generate`` (the hf tier compares with transformers itself).
"""

from __future__ import annotations

import json

import pytest

from lowrank_jax.models.tokenizer import BPETokenizer, folder_tokenizer

# Llama 3 Instruct's and Gemma's templates as their tokenizer_config.json ship them
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
SPECIAL = {"llama3": ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                      "<|end_header_id|>"],
           "gemma": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]}


def write_tokenizer(folder, family: str) -> None:
    """A small word-level tokenizer.json with the family's special tokens, and its
    tokenizer_config.json (template, bos, eos) as transformers writes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = SPECIAL[family]
    words = ["user", "assistant", "model", "Hi", "there", "\n", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = (special[0], special[1])
    config = {"bos_token": bos, "eos_token": eos if family == "gemma" else "<|eot_id|>",
              "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": LLAMA3_TEMPLATE if family == "llama3" else GEMMA_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


CHAT = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "there"},
        {"role": "user", "content": "Hi"}]
EXPECTED = {
    "llama3": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nthere<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gemma": ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nthere"
              "<end_of_turn>\n<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_stored_chat_template_is_rendered_and_ends_turns(family, tmp_path):
    write_tokenizer(tmp_path, family)
    tok = folder_tokenizer(tmp_path)
    assert isinstance(tok, BPETokenizer)
    prompt = tok.apply_chat_template(CHAT)
    assert prompt == EXPECTED[family]
    ids = tok.encode(prompt)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id  # no second BOS
    end_of_turn = "<|eot_id|>" if family == "llama3" else "<end_of_turn>"
    assert tok.tokenizer.token_to_id(end_of_turn) in tok.stop_ids


def test_template_errors_are_clear(tmp_path):
    write_tokenizer(tmp_path, "gemma")
    tok = folder_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="System role not supported"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "x"}])


def test_generate_cli_uses_the_template(tmp_path, capsys, monkeypatch):
    """`lowrank-jax generate --chat` wraps the prompt in the folder's template."""
    from flax import nnx

    from lowrank_jax.cli import main
    from lowrank_jax.hub import save_model
    from lowrank_jax.models.families import config_from_hf
    from lowrank_jax.models.llama import Llama
    from lowrank_jax.models.tokenizer import BPETokenizer as Tok

    write_tokenizer(tmp_path / "m", "gemma")
    cfg = config_from_hf({"model_type": "gemma", "vocab_size": 11, "hidden_size": 16,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8,
                          "intermediate_size": 16})
    save_model(Llama(cfg, rngs=nnx.Rngs(0)), tmp_path / "m")
    seen = []
    original = Tok.encode
    monkeypatch.setattr(Tok, "encode", lambda self, text, **k: seen.append(text)
                        or original(self, text, **k))
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "Hi",
                 "--max-new-tokens", "2"]) == 0
    assert seen[0] == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.hf
@pytest.mark.parametrize("family", ["llama3", "gemma"])
def test_chat_template_renders_as_transformers_renders_it(family, tmp_path):
    """hf tier: transformers' ``apply_chat_template`` on the same folder gives the same text."""
    try:
        import transformers
    except ImportError as err:
        pytest.fail(f"the hf tier needs transformers: pip install transformers ({err})")
    write_tokenizer(tmp_path, family)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for add in (True, False):
        want = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add)
        assert folder_tokenizer(tmp_path).apply_chat_template(
            CHAT, add_generation_prompt=add) == want
