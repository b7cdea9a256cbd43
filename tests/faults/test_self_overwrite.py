"""Issue 40, finding 2: no command writes into a folder it reads from (``--out`` equal to,
inside or containing ``--run`` / ``--model`` / ``--adapter`` / ``--hyper`` / an input file),
with or without ``--overwrite``; and a run folder's kind never changes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest


def sets(overrides):
    return [a for s in overrides for a in ("--set", s)]


def _copy(run, tmp_path, name="run"):
    target = tmp_path / name
    shutil.copytree(run, target)
    return target


@pytest.mark.parametrize("overwrite", [True, False], ids=["--overwrite", "no --overwrite"])
def test_export_into_its_own_run_is_refused_and_the_run_resumes(faults, salaad_run, tiny_salaad,
                                                                 tmp_path, overwrite):
    run = _copy(salaad_run, tmp_path)
    argv = ["export", "--run", run, "--budget", "0.5", "--out", run]
    line = faults.expect_error(argv + (["--overwrite"] if overwrite else []),
                               f"--out {run} is --run {run}: a command never writes into what "
                               "it reads (not even with --overwrite)")
    assert "choose a separate --out" in line
    assert json.loads((run / ".lowrank-jax.json").read_text()) == {"command": "pretrain"}
    # the user's run is still theirs: resuming it (two more steps) works
    code, out, err = faults.cli(["pretrain", "--no-progress", "--resume",
                                 *sets(tiny_salaad + ["train.steps=6", f"run_dir={run}"])],
                                out=run)
    assert code == 0, err
    assert "resumed from step 4" in out
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    faults.recovered()


def test_export_inside_its_run_is_refused(faults, salaad_run, tmp_path):
    run = _copy(salaad_run, tmp_path)
    faults.expect_error(["export", "--run", run, "--budget", "0.5", "--out", run / "export",
                         "--overwrite"], f"--out {run / 'export'} lies inside --run {run}")
    assert not (run / "export").exists()


@pytest.mark.parametrize("command", ["finetune", "analyze", "quantize", "edit", "merge"])
def test_a_pretrain_run_never_becomes_another_kind(faults, tiny_runs, tmp_path, command):
    """--overwrite replaces a run of the same command, never a folder of another kind."""
    run = _copy(tiny_runs["split"], tmp_path)
    edits = tmp_path / "edits.jsonl"
    edits.write_text(json.dumps({"prompt": "The capital of France is", "target": " Rome"}) + "\n")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    argv = {
        "finetune": ["finetune", "--model", "tiny", "--steps", "1", "--no-progress"],
        "analyze": ["analyze", "--model", "tiny"],
        "quantize": ["quantize", "--model", "tiny"],
        "edit": ["edit", "--edits", edits, "--model", "tiny"],
        "merge": ["merge", "--model", "tiny", "--adapter", adapter],
    }[command]
    line = faults.expect_error([*argv, "--out", run, "--overwrite"],
                               f"--out {run}: the folder holds a pretrain run; choose another "
                               f"folder for {command}")
    assert "a folder's kind never changes, not even with --overwrite" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


def _inputs(tmp_path):
    """Input files and folders as a user has them (nothing here is loaded: the check comes
    first)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    hyper = tmp_path / "hyper"
    hyper.mkdir()
    (hyper / "config.json").write_text("{}")
    text = tmp_path / "data" / "text.txt"
    text.parent.mkdir()
    text.write_text("some text to read " * 20)
    emb = tmp_path / "emb.npy"
    np.save(emb, np.ones((8, 4), np.float32))
    jobs = tmp_path / "jobs" / "jobs.yaml"
    jobs.parent.mkdir()
    jobs.write_text(f"model: tiny\nout: {jobs.parent}\njobs:\n  - {{name: a, rank: 2}}\n")
    edits = tmp_path / "data" / "edits.jsonl"
    edits.write_text(json.dumps({"prompt": "The capital of France is", "target": " Rome"}) + "\n")
    fed = tmp_path / "fed" / "fed.yaml"
    fed.parent.mkdir()
    fed.write_text("name: x\n")
    return dict(model=model, adapter=adapter, hyper=hyper, text=text, emb=emb, jobs=jobs,
                edits=edits, fed=fed)


# (argv, the message's start); each path is a key of _inputs, or key/sub for a path below it
CASES = {
    "quantize --out = --model": (["quantize", "--model", "model", "--out", "model"],
                                 "--out {model} is --model {model}"),
    "quantize --out contains --calib-file": (
        ["quantize", "--model", "tiny", "--calib-file", "text", "--out", "data"],
        "--out {data} contains --calib-file {text}"),
    "merge --out inside --adapter": (
        ["merge", "--model", "tiny", "--adapter", "adapter", "--out", "adapter/merged"],
        "--out {adapter/merged} lies inside --adapter {adapter}"),
    "merge --out = --model": (["merge", "--model", "model", "--adapter", "adapter", "--out",
                               "model"], "--out {model} is --model {model}"),
    "internalize --out = --hyper": (
        ["internalize", "--model", "tiny", "--doc", "text", "--hyper", "hyper", "--out",
         "hyper"], "--out {hyper} is --hyper {hyper}"),
    "internalize --out contains --doc": (
        ["internalize", "--model", "tiny", "--doc", "text", "--out", "data"],
        "--out {data} contains --doc {text}"),
    "analyze --out = --model": (["analyze", "--model", "model", "--out", "model"],
                                "--out {model} is --model {model}"),
    "edit --out contains --edits": (["edit", "--edits", "edits", "--model", "tiny", "--out",
                                     "data"], "--out {data} contains --edits {edits}"),
    "finetune --out contains --data": (
        ["finetune", "--model", "tiny", "--data", "text", "--no-progress", "--out", "data"],
        "--out {data} contains --data {text}"),
    "finetune --out inside --model": (
        ["finetune", "--model", "model", "--no-progress", "--out", "model/ft"],
        "--out {model/ft} lies inside --model {model}"),
    "finetune --jobs out contains the jobs file": (
        ["finetune", "--jobs", "jobs", "--no-progress"], "--out {jobs_dir} contains --jobs {jobs}"),
    "select --out = --embeddings": (["select", "--embeddings", "emb", "--budget", "2", "--out",
                                     "emb"], "--out {emb} is --embeddings {emb}"),
    "federate run_dir contains --config": (
        ["federate", "--config", "fed", "--run-dir", "fed_dir", "--no-progress"],
        "run_dir {fed_dir} contains --config {fed}"),
}


@pytest.mark.parametrize("overwrite", [True, False], ids=["--overwrite", "no --overwrite"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_output_over_an_input_is_refused(faults, tmp_path, case, overwrite):
    paths = _inputs(tmp_path)
    paths.update(data=paths["text"].parent, jobs_dir=paths["jobs"].parent,
                 fed_dir=paths["fed"].parent)

    def resolve(name):
        head, _, tail = name.partition("/")
        if head not in paths:
            return name
        return paths[head] / tail if tail else paths[head]

    argv, message = CASES[case]
    argv = [resolve(a) for a in argv]
    if overwrite and argv[0] not in ("select", "federate"):
        argv.append("--overwrite")
    for key in list(paths):
        for sub in ("", "/merged", "/ft"):
            message = message.replace("{" + key + sub + "}", str(resolve(key + sub)))
    line = faults.expect_error(argv, message)
    assert "a command never writes into what it reads" in line


def test_pretrain_resume_in_its_own_run_is_not_self_overwrite(faults, tiny_runs, tiny, tmp_path):
    """The one folder read and written on purpose: a run continued with --resume."""
    run = _copy(tiny_runs["split"], tmp_path)
    code, out, err = faults.cli(["pretrain", "--no-progress", "--resume",
                                 *sets(tiny + [f"run_dir={run}"])], out=run)
    assert code == 0, err
    assert "resumed from step 4" in out
    faults.recovered()
