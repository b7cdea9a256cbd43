"""``lowrank_jax.runs.outputs``: output folders are claimed, refused or replaced as documented."""

import json

import pytest

from lowrank_jax.runs.outputs import (
    MARKER,
    atomic_write_text,
    inside,
    prepare_output,
    staged_folder,
)


def test_new_folder_is_created_with_its_owner(tmp_path):
    out = prepare_output(tmp_path / "a" / "b", command="finetune")
    assert out.is_dir() and json.loads((out / MARKER).read_text()) == {"command": "finetune"}
    # claimed but still empty: a second start is fine
    assert prepare_output(out, command="finetune") == out


def test_our_run_is_refused_then_resumed_or_overwritten(tmp_path):
    out = prepare_output(tmp_path / "run", command="pretrain")
    (out / "checkpoints" / "2").mkdir(parents=True)  # a run with a checkpoint (step 2)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("the user's notes")
    with pytest.raises(ValueError, match="already holds a pretrain run .*pass `resume`"):
        prepare_output(out, command="pretrain")
    with pytest.raises(ValueError, match="holds a pretrain run; choose another folder for "
                                         "finetune"):
        prepare_output(out, command="finetune")
    assert prepare_output(out, command="pretrain", resume=True) == out
    prepare_output(out, command="pretrain", overwrite=True,
                   owned_names=("checkpoints", "metrics.jsonl"))
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "notes.txt"]  # only ours removed


def test_resume_of_a_run_made_before_markers_is_accepted(tmp_path):
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    assert prepare_output(tmp_path / "old", command="pretrain", resume=True).is_dir()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"not empty \(data.csv\) and was not created by"):
        prepare_output(tmp_path / "mine", command="pretrain", resume=True)


def test_inside_rejects_escaping_names(tmp_path):
    assert inside(tmp_path, "job-1") == tmp_path / "job-1"
    for name in ("../x", "/abs", "a/../../b", "~user", ""):
        with pytest.raises(ValueError, match="would write outside"):
            inside(tmp_path, name, argument="job name")


def test_staged_folder_replaces_files_and_keeps_others(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "config.json").write_text("old")
    (folder / "README").write_text("keep me")
    with staged_folder(folder) as tmp:
        (tmp / "config.json").write_text("new")
    assert (folder / "config.json").read_text() == "new"
    assert (folder / "README").read_text() == "keep me"
    with pytest.raises(RuntimeError), staged_folder(folder) as tmp:
        (tmp / "config.json").write_text("half")
        raise RuntimeError("crash while writing")
    assert (folder / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_atomic_write_leaves_no_temporary(tmp_path):
    atomic_write_text(tmp_path / "summary.json", "{}")
    atomic_write_text(tmp_path / "summary.json", '{"a": 1}')
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"a": 1}
