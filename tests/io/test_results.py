"""The result writer: JSON payload and Markdown note of a reproduction."""

import json

from lowrank_jax.runs.results import markdown_table, write_result


def test_write_result_writes_json_and_note(tmp_path, capsys):
    rows = [{"arm": "lora", "nll": 1.234567}, {"arm": "balora", "nll": 2}]
    payload = write_result(tmp_path / "sub" / "llm_demo", "Demo", ["arm", "nll"], rows, "Ok.",
                           extra={"seconds": 1.5}, note="![plot](x.png)")
    saved = json.loads((tmp_path / "sub" / "llm_demo.json").read_text())
    assert saved == payload
    assert saved["rows"] == rows and saved["verdict"] == "Ok." and saved["seconds"] == 1.5
    note = (tmp_path / "sub" / "llm_demo.md").read_text().splitlines()
    assert note[0] == "# Demo"
    assert note[4:8] == ["| arm | nll |", "|---|---|", "| lora | 1.235 |", "| balora | 2 |"]
    assert note[-2:] == ["![plot](x.png)", ""] or note[-1] == "![plot](x.png)"
    out = capsys.readouterr().out
    assert "| lora | 1.235 |" in out and out.strip().endswith("llm_demo.json")


def test_markdown_table_lines():
    assert markdown_table(["a"], [{"a": 0.5}]) == ["| a |", "|---|", "| 0.5 |"]


def test_record_folder_reads_only_its_protocol(tmp_path):
    from lowrank_jax.runs.results import RecordFolder

    store = RecordFolder(tmp_path / "rows", {"model": "tiny", "layers": [0, 1]})
    assert store.read("fp32") is None
    store.write("fp32", rows=[{"ppl": 3.25}], folder={"path": "x"})
    saved = json.loads((tmp_path / "rows" / "fp32.json").read_text())
    assert saved == {"fingerprint": {"model": "tiny", "layers": [0, 1]},
                     "rows": [{"ppl": 3.25}], "folder": {"path": "x"}}
    assert RecordFolder(tmp_path / "rows", {"model": "tiny", "layers": [0, 1]}).read(
        "fp32")["rows"] == [{"ppl": 3.25}]
    assert RecordFolder(tmp_path / "rows", {"model": "tiny", "layers": [0]}).read("fp32") is None
