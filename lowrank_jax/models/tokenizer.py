"""Tokenizers for real checkpoints (byte-level BPE) and for the byte-level corpus models.

Both expose one interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``apply_chat_template(messages, add_generation_prompt=True) -> str``, ``bos_id``, ``eos_id``,
``vocab_size``.

Byte-level BPE (GPT-2 style, as in SmolLM2 and Llama-3): text is split by a regex
pre-tokenizer, each piece is mapped byte-by-byte to printable unicode characters, and the learned
merges are applied in rank order. The vocabulary and merges come either from GGUF metadata
(``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``, ``tokenizer.ggml.token_type``) or from a
HF ``tokenizer.json``; the ``tokenizers`` package runs the algorithm.

Chat format: the model's own template. ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, the
template SmolLM2 and Qwen ship) is recognised and rendered directly, with the default system
prompt read from the stored Jinja template when it has one; any other stored template (Llama 3,
Gemma, Mistral, Phi-3) is rendered with Jinja as transformers renders it
(:func:`render_chat_template`: sandboxed, ``trim_blocks``/``lstrip_blocks``, ``bos_token`` /
``eos_token`` and ``raise_exception`` defined). :attr:`BPETokenizer.stop_ids` adds the
end-of-turn tokens these templates use (``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``) to the
end token, and :meth:`BPETokenizer.encode` does not add a second BOS to text that starts with it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# a model folder holding this file is a byte-level model: its tokens are bytes (no tokenizer.json)
BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
#: End-of-turn tokens of the chat templates (generation stops at them as at the end token).
END_OF_TURN_TOKENS = (IM_END, "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")


def is_chatml(template: str | None) -> bool:
    """Whether a stored chat template is ChatML (rendered without Jinja)."""
    return bool(template) and IM_START in template and IM_END in template


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """Render a stored Jinja chat template as transformers' ``apply_chat_template`` does.

    Args:
        template: the ``chat_template`` string of ``tokenizer_config.json`` / GGUF metadata.
        messages: ``{"role", "content"}`` dicts.
        add_generation_prompt: end with the assistant turn's header.
        bos_token, eos_token: the special tokens' text (templates insert them).

    Returns:
        The prompt text.

    Example::

        >>> render_chat_template(
        ...     "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        ...     "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        ...     [{"role": "user", "content": "Hi"}], bos_token="<s>")
        '<s><user>Hi<assistant>'
    """
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("this model's chat template is Jinja (not ChatML); rendering it needs "
                         "jinja2: pip install jinja2 (or pass the prompt as it is, `raw`)."
                         ) from None
    from datetime import datetime

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"messages[{i}]={message!r} must be a dict with 'role' and 'content' keys.")
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as err:
        raise ValueError(f"chat template does not parse ({err}).") from None
    return compiled.render(messages=[dict(m) for m in messages],
                           add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token or "", eos_token=eos_token or "")


def _default_system_prompt(template: str | None) -> str | None:
    """The system message a ChatML Jinja template inserts when the chat has none."""
    if not template:
        return None
    match = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
    if match and "message" not in match.group(1):
        return match.group(1)
    return None


def chatml(
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    default_system: str | None = None,
) -> str:
    """Render ``messages`` (``{"role", "content"}`` dicts) in the ChatML format.

    Example::

        >>> chatml([{"role": "user", "content": "Hi"}])
        '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"messages[{i}]={message!r} must be a dict with 'role' and 'content' keys."
            )
        if i == 0 and message["role"] != "system" and default_system:
            parts.append(f"{IM_START}system\n{default_system}{IM_END}\n")
        parts.append(f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


class BPETokenizer:
    """Byte-level BPE tokenizer backed by ``tokenizers.Tokenizer``.

    Example::

        >>> tok = BPETokenizer.from_gguf_metadata(meta)  # doctest: +SKIP
        >>> tok.decode(tok.encode("Hello world"))  # doctest: +SKIP
        'Hello world'

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        bos_id, eos_id: special ids (``None`` when the model has none).
        chat_template: the stored Jinja template string (used for its default system prompt).
        add_bos: prepend ``bos_id`` in :meth:`encode` by default.
    """

    def __init__(
        self,
        tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None = None,
        add_bos: bool = False,
    ):
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.default_system = _default_system_prompt(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "BPETokenizer":
        """Build from GGUF metadata (``tokenizer.ggml.model == "gpt2"``)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model={kind!r} is not supported; only byte-level BPE ('gpt2') "
                "tokenizers load from GGUF."
            )
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {token: i for i, token in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
        tok = Tokenizer(bpe)
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact", "qwen2", "deepseek-llm"):
            # DERIVED from llama.cpp's pre-tokenizer table: these split every digit apart.
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types) if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
        ]
        tok.add_special_tokens(special)

        def opt_int(key):
            value = meta.get(key)
            return None if value is None else int(value)

        return cls(
            tok,
            bos_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_id=opt_int("tokenizer.ggml.eos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "BPETokenizer":
        """Build from a HF folder's ``tokenizer.json`` (+ ``tokenizer_config.json`` if present)."""
        from tokenizers import Tokenizer

        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder}: no tokenizer.json; pass token ids instead.")
        try:
            tok = Tokenizer.from_file(path)
        except Exception as err:
            raise ValueError(f"{path}: unreadable tokenizer.json ({err}).") from None
        config: dict[str, Any] = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else tok.token_to_id(value)

        eos = token_id("eos_token")
        if eos is None:
            for candidate in ("<|endoftext|>", "</s>", "<|eot_id|>", IM_END):
                if tok.token_to_id(candidate) is not None:
                    eos = tok.token_to_id(candidate)
                    break
        return cls(
            tok,
            bos_id=token_id("bos_token"),
            eos_id=eos,
            chat_template=config.get("chat_template"),
            add_bos=bool(config.get("add_bos_token", False)),
        )

    def save(self, folder: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder``."""
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        self.tokenizer.save(os.path.join(folder, "tokenizer.json"))

        def name(i):
            return None if i is None else self.tokenizer.id_to_token(i)

        config = {
            "bos_token": name(self.bos_id),
            "eos_token": name(self.eos_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` (special tokens such as ``<|im_start|>`` are recognised; no
        second BOS when the text already starts with it, as a rendered chat template does)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}.")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if ((self.add_bos if add_bos is None else add_bos) and self.bos_id is not None
                and ids[:1] != [self.bos_id]):
            ids = [self.bos_id] + ids
        return ids

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The end token and the chat templates' end-of-turn tokens this vocabulary has."""
        ids = [] if self.eos_id is None else [self.eos_id]
        for token in END_OF_TURN_TOKENS:
            i = self.tokenizer.token_to_id(token)
            if i is not None and i not in ids:
                ids.append(i)
        return tuple(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The stored string of one token (byte-level symbols, e.g. ``Ġthe``)."""
        return self.tokenizer.id_to_token(int(token_id))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text in the model's chat format: ChatML (with the template's default
        system prompt when it has one) or the stored Jinja template
        (:func:`render_chat_template`); ChatML when the model stores none."""
        if self.chat_template and not is_chatml(self.chat_template):
            def text(i):
                return None if i is None else self.tokenizer.id_to_token(i)

            return render_chat_template(self.chat_template, messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=text(self.bos_id), eos_token=text(self.eos_id))
        return chatml(
            messages,
            add_generation_prompt=add_generation_prompt,
            default_system=self.default_system,
        )


class ByteTokenizer:
    """Bytes as tokens (ids 0..255), the tokenizer of the embedded-corpus models.

    Example::

        >>> tok = ByteTokenizer()
        >>> tok.encode("hi")
        [104, 105]
        >>> tok.decode([104, 105])
        'hi'
    """

    vocab_size = 256
    bos_id: int | None = None
    eos_id: int | None = None
    chat_template = None

    def save(self, folder: str | os.PathLike) -> None:
        """Write the byte-level marker :data:`BYTE_TOKENIZER_FILE` (what
        :func:`folder_tokenizer` reads back as a :class:`ByteTokenizer`)."""
        with open(os.path.join(os.fspath(folder), BYTE_TOKENIZER_FILE), "w") as f:
            json.dump({"tokenizer": "bytes", "vocab_size": 256}, f)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        del add_bos
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}.")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        del skip_special_tokens
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return bytes([int(token_id) % 256]).decode("latin-1")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        return chatml(messages, add_generation_prompt=add_generation_prompt)


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any]) -> BPETokenizer:
    """Shortcut for :meth:`BPETokenizer.from_gguf_metadata`."""
    return BPETokenizer.from_gguf_metadata(meta)


def folder_tokenizer(folder: str | os.PathLike):
    """The tokenizer stored in a model folder: a :class:`BPETokenizer` from ``tokenizer.json``,
    a :class:`ByteTokenizer` where the byte-level marker :data:`BYTE_TOKENIZER_FILE` lies (a
    byte model such as ``lowrank-jax export`` writes), otherwise ``None``.

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> folder_tokenizer(folder) is None
        True
        >>> _ = open(os.path.join(folder, BYTE_TOKENIZER_FILE), "w").write("{}")
        >>> type(folder_tokenizer(folder)).__name__
        'ByteTokenizer'
    """
    folder = os.fspath(folder)
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return BPETokenizer.from_folder(folder)
    if os.path.isfile(os.path.join(folder, BYTE_TOKENIZER_FILE)):
        return ByteTokenizer()
    return None


__all__ = ["BYTE_TOKENIZER_FILE", "BPETokenizer", "ByteTokenizer", "END_OF_TURN_TOKENS", "chatml",
           "folder_tokenizer", "is_chatml", "render_chat_template",
           "tokenizer_from_gguf_metadata"]
