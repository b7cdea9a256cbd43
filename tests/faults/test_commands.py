"""Issue 40, build 3: the fault discipline (one line naming the argument / file, exit 2,
nothing outside the output changed, the stderr budget) over the commands and options added
since the suite was written: launch, merge, export, internalize, federate, select,
quantize --bits/--method, generate --adapter/--kv/--raw, eval --kv, finetune
--quantize/--jobs and pretrain --set structure=salaad. Each case fails before any real work
(the checks come first), so the whole table runs in seconds."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture
def inputs(tmp_path):
    """Input files a user might hand the commands, under ``d/`` (relative to the test's
    working folder, so messages name them as typed)."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "text.txt").write_text("hello world " * 50)
    (d / "empty.txt").write_text("")
    np.save(d / "emb.npy", np.ones((16, 4), np.float32))
    nan = np.ones((16, 4), np.float32)
    nan[5, 2] = np.nan
    np.save(d / "emb_nan.npy", nan)
    np.save(d / "emb_1d.npy", np.ones(16, np.float32))
    np.save(d / "loss_short.npy", np.ones(3, np.float32))
    np.save(d / "loss_inf.npy", np.array([1.0] * 15 + [np.inf], np.float32))
    (d / "bad.npy").write_bytes(b"not numpy at all")
    (d / "fed.yaml").write_text("nope: 1\n")
    (d / "fedbad.yaml").write_text("name: [\n")
    (d / "jobs_list.yaml").write_text("jobs: 3\n")
    (d / "jobs_lr.yaml").write_text("out: o/jobs\njobs:\n  - {name: a, rank: 2, lr: .nan}\n")
    (d / "notadapter").mkdir()
    (d / "adapter_bad").mkdir()
    (d / "adapter_bad" / "adapter_config.json").write_text("{bad")
    (d / "run_plain" / "checkpoints").mkdir(parents=True)
    return d


SALAAD = ["--set", "structure=salaad", "--set", "model.projection=dense"]

# command: [(argv, the message the one stderr line must contain)]
CASES = {
    "launch": [
        (["launch", "--processes", "2"], "launch: no command given; put it after --"),
        (["launch", "--", "launch"], "the command to run cannot be launch itself"),
        (["launch", "--processes", "0", "--", "plan", "--devices", "1"],
         "argument --processes: 0 must be a positive integer"),
        (["launch", "--stop-timeout", "-1", "--", "plan", "--devices", "1"],
         "argument --stop-timeout: -1.0 must be > 0"),
    ],
    "merge": [
        (["merge", "--model", "tiny", "--adapter", "d/none", "--out", "o"],
         "--adapter d/none: no such folder; pass a PEFT adapter folder"),
        (["merge", "--model", "tiny", "--adapter", "d/notadapter", "--out", "o"],
         "d/notadapter/adapter_config.json not found; a PEFT adapter folder holds"),
        (["merge", "--model", "tiny", "--adapter", "d/adapter_bad", "--out", "o"],
         "d/adapter_bad/adapter_model.safetensors not found"),
        (["merge", "--model", "tiny", "--adapter", "d/notadapter", "--data", "d/none.txt",
          "--out", "o"], "--data d/none.txt: file not found; pass a UTF-8 text file"),
        (["merge", "--model", "tiny", "--adapter", "d/notadapter", "--eval-tokens", "0",
          "--out", "o"], "argument --eval-tokens: 0 must be a positive integer"),
        (["merge", "--model", "tiny", "--adapter", "d/notadapter", "--to", "int8", "--out",
          "o"], "argument --to: invalid choice: 'int8'"),
    ],
    "export": [
        (["export", "--run", "d/none", "--budget", "0.5", "--out", "o"],
         "--run d/none: no config.yaml; pass the run_dir of a `lowrank-jax pretrain` run"),
        (["export", "--run", "d/none", "--budget", "0", "--out", "o"],
         "argument --budget: 0.0 must be > 0"),
        (["export", "--run", "d/run_plain", "--budget", "1.5", "--out", "o"],
         "--budget 1.5: must be a fraction of the parameters in (0, 1]"),
        (["export", "--run", "d/run_plain", "--budget", "nan", "--out", "o"],
         "argument --budget: 'nan' must be a finite number"),
        (["export", "--run", "d/run_plain", "--budget", "0.5", "--gamma", "nan", "--out", "o"],
         "--gamma nan: must lie in [0, 1]"),
        (["export", "--run", "d/run_plain", "--budget", "0.5", "--out", "o"],
         "--run d/run_plain: no config.yaml"),
    ],
    "internalize": [
        (["internalize", "--model", "tiny", "--doc", "d/none.txt", "--out", "o"],
         "--doc d/none.txt: file not found"),
        (["internalize", "--model", "tiny", "--doc", "d/empty.txt", "--out", "o"],
         "--doc d/empty.txt: the file is empty"),
        (["internalize", "--model", "tiny", "--doc", "d/text.txt", "--hyper", "d/none",
          "--out", "o"], "d/none: no doc_to_lora.json there"),
        (["internalize", "--model", "tiny", "--doc", "d/text.txt", "--layers", "x", "--out",
          "o"], "--layers 'x': give comma-separated integers"),
        (["internalize", "--model", "tiny", "--doc", "d/text.txt", "--layers", "99", "--out",
          "o"], "--layers '99': layers must lie in 0..1"),
        (["internalize", "--model", "tiny", "--doc", "d/text.txt", "--chunk-len", "0",
          "--out", "o"], "argument --chunk-len: 0 must be a positive integer"),
    ],
    "federate": [
        (["federate", "--config", "d/none.yaml"], "--config 'd/none.yaml' does not exist"),
        (["federate", "--config", "d/fed.yaml"], "d/fed.yaml: unknown keys ['nope']"),
        (["federate", "--config", "d/fedbad.yaml"],
         "--config d/fedbad.yaml: invalid YAML at line 2"),
        (["federate", "--config", "d/fed.yaml", "--seeds", "a,b"],
         "--seeds 'a,b': give integers like 0,1,2"),
        (["federate", "--config", "d/fed.yaml", "--rounds", "0"],
         "argument --rounds: 0 must be a positive integer"),
    ],
    "select": [
        (["select", "--embeddings", "d/emb.npy", "--budget", "0", "--out", "o.npy"],
         "--budget 0 must be a positive number of draws"),
        (["select", "--embeddings", "d/none.npy", "--budget", "2", "--out", "o.npy"],
         "--embeddings d/none.npy: no such file"),
        (["select", "--embeddings", "d/bad.npy", "--budget", "2", "--out", "o.npy"],
         "--embeddings d/bad.npy: not a NumPy .npy array"),
        (["select", "--embeddings", "d/emb_nan.npy", "--budget", "2", "--out", "o.npy"],
         "--embeddings d/emb_nan.npy: row 5 holds NaN or inf values"),
        (["select", "--embeddings", "d/emb_1d.npy", "--budget", "2", "--out", "o.npy"],
         "must be a 2-D [n, d] embedding matrix, got shape (16,)"),
        (["select", "--embeddings", "d/emb.npy", "--losses", "d/loss_short.npy", "--budget",
          "2", "--out", "o.npy"], "losses has shape (3,); give one loss per row, (16,)"),
        (["select", "--embeddings", "d/emb.npy", "--losses", "d/loss_inf.npy", "--budget",
          "2", "--out", "o.npy"], "--losses d/loss_inf.npy: row 15 holds NaN or inf"),
        (["select", "--embeddings", "d/emb.npy", "--budget", "2", "--rank", "0", "--out",
          "o.npy"], "argument --rank: 0 must be a positive integer"),
        (["select", "--embeddings", "d/emb.npy", "--budget", "2", "--chunk-rows", "0",
          "--out", "o.npy"], "argument --chunk-rows: 0 must be a positive integer"),
        (["select", "--embeddings", "d/emb.npy", "--budget", "2", "--out", "nodir/x/o.npy"],
         "nodir/x/o.npy: no such file or directory"),
    ],
    "quantize": [
        (["quantize", "--model", "tiny", "--bits", "5", "--out", "o"],
         "--bits 5 is not supported by --method unisvq; use one of (2, 3, 4)"),
        (["quantize", "--model", "tiny", "--method", "kmeans", "--bits", "4", "--out", "o"],
         "--bits 4 is not supported by --method kmeans; use one of (2,)"),
        (["quantize", "--model", "tiny", "--method", "rtn", "--bits", "1", "--out", "o"],
         "--bits 1 is not supported by --method rtn"),
        (["quantize", "--model", "tiny", "--method", "gptq", "--out", "o"],
         "argument --method: invalid choice: 'gptq'"),
        (["quantize", "--model", "tiny", "--group-size", "0", "--out", "o"],
         "argument --group-size: 0 must be a positive integer"),
        (["quantize", "--model", "d/none", "--out", "o"],
         "--model 'd/none' is neither a known name"),
        (["quantize", "--model", "tiny", "--calib-file", "d/none.txt", "--out", "o"],
         "--calib-file 'd/none.txt' does not exist"),
    ],
    "generate": [
        (["generate", "--model", "tiny", "--adapter", "d/none", "--prompt", "hi"],
         "--adapter d/none: d/none/adapter_config.json not found"),
        (["generate", "--model", "tiny", "--adapter", "d/adapter_bad", "--prompt", "hi"],
         "--adapter d/adapter_bad: d/adapter_bad/adapter_model.safetensors not found"),
        (["generate", "--model", "tiny", "--prompt", "a", "--prompt", "b"],
         "--prompt was given several times; that needs one --adapter each"),
        (["generate", "--model", "tiny", "--kv", "nope", "--prompt", "hi"],
         "argument --kv: invalid choice: 'nope'"),
        (["generate", "--model", "tiny", "--kv", "xkv", "--temperature", "0.5", "--prompt",
          "hi"], "--kv xkv generates greedily; drop --temperature"),
        (["generate", "--model", "tiny", "--raw", "--chat", "--prompt", "hi"],
         "argument --chat: not allowed with argument --raw"),
        (["generate", "--model", "tiny", "--top-p", "2", "--prompt", "hi"],
         "--top-p 2.0 must lie in (0, 1]"),
        (["generate", "--model", "tiny", "--kv", "xkv", "--kv-ratio", "0", "--prompt", "hi"],
         "argument --kv-ratio: 0.0 must be > 0"),
    ],
    "eval": [
        (["eval", "--model", "tiny", "--kv", "nope"], "argument --kv: invalid choice: 'nope'"),
        (["eval", "--model", "tiny", "--kv", "xkv", "--kv-ratio", "nan"],
         "argument --kv-ratio: 'nan' must be a finite number"),
        (["eval", "--model", "tiny", "--kv", "xkv", "--kv-group", "0"],
         "argument --kv-group: 0 must be a positive integer"),
        (["eval", "--model", "tiny", "--kv", "xkv", "--kv-eval-tokens", "0"],
         "argument --kv-eval-tokens: 0 must be a positive integer"),
        (["eval", "--model", "tiny", "--text", "d/none.txt"], "--text d/none.txt: no such file"),
        (["eval", "--model", "tiny", "--max-tokens", "1"], "--max-tokens 1 must be at least 2"),
    ],
    "finetune": [
        (["finetune", "--quantize", "int3", "--out", "o"],
         "argument --quantize: invalid choice: 'int3'"),
        (["finetune", "--quantize", "nf4", "--method", "pissa", "--steps", "1",
          "--no-progress", "--out", "o"],
         "--method pissa rewrites the base weights; with --quantize use lora, balora or lokra"),
        (["finetune", "--save-base", "b", "--steps", "1", "--no-progress", "--out", "o"],
         "--save-base writes the quantized base; it needs --quantize"),
        (["finetune", "--jobs", "d/none.yaml", "--out", "o"],
         "--jobs d/none.yaml: file not found"),
        (["finetune", "--jobs", "d/jobs_list.yaml", "--out", "o"],
         "--jobs d/jobs_list.yaml: 'jobs' must be a list of mappings"),
        (["finetune", "--jobs", "d/jobs_lr.yaml", "--out", "o"],
         "--jobs d/jobs_lr.yaml: job 'a' lr=nan must be > 0"),
        (["finetune", "--jobs", "d/jobs_lr.yaml", "--mesh", "data=3", "--out", "o"],
         "mesh data=3 x fsdp=1 x tensor=1 needs 3 devices, but "),
    ],
    "jobs": [
        (["jobs", "d/none.yaml", "--out", "o"], "jobs file d/none.yaml: file not found"),
        (["jobs", "d/jobs_list.yaml", "--out", "o"],
         "jobs file d/jobs_list.yaml: 'jobs' must be a list of mappings"),
        (["jobs", "d/jobs_lr.yaml", "--out", "o"],
         "jobs file d/jobs_lr.yaml: job 'a' lr=nan must be > 0"),
        (["jobs", "d/jobs_lr.yaml", "--rank", "4"], "unrecognized arguments: --rank 4"),
    ],
    # the older commands, so that every command of `lowrank-jax --help` has cases here
    "bench": [
        (["bench", "--only", "nope", "--out", "o"], "--only nope: unknown benchmark; choose "
                                                    "from spectron_overhead"),
        (["bench", "--reps", "0", "--out", "o"], "argument --reps: 0 must be a positive"),
        (["bench", "--out", "d/text.txt", "--only", "load_time"],
         "--out d/text.txt: is a file, not a folder"),
    ],
    "plan": [
        (["plan", "--devices", "0"], "--devices=0 must be a positive integer"),
        (["plan", "--devices", "1", "--config", "d/none.yaml"],
         "Config 'd/none.yaml' not found; presets: ['1b'"),
        (["plan", "--devices", "1", "--set", "model.d_model=-1"],
         "model.d_model=-1 must be a positive integer"),
        (["plan", "--devices", "1", "--set", "nokey=1"], "Unknown config key 'nokey'"),
    ],
    "analyze": [
        (["analyze", "--model", "d/none", "--out", "o"], "--model 'd/none' is neither a "
                                                         "known name"),
        (["analyze", "--model", "tiny", "--top-k", "0", "--out", "o"],
         "argument --top-k: 0 must be a positive integer"),
    ],
    "edit": [
        (["edit", "--edits", "d/none.jsonl", "--out", "o"], "--edits d/none.jsonl: file not "
                                                            "found"),
        (["edit", "--edits", "d/text.txt", "--gamma", "0", "--out", "o"],
         "--gamma 0.0 must lie in (0, 1]"),
    ],
    "pretrain structure=salaad": [
        (["pretrain", "--set", "structure=salaad", "--set", "run_dir=o"],
         "structure=salaad needs model.projection=dense"),
        (["pretrain", *SALAAD, "--set", "salaad.rho=0", "--set", "run_dir=o"],
         "salaad.rho=0 must be > 0"),
        (["pretrain", "--set", "structure=sparse", "--set", "run_dir=o"],
         "structure='sparse' is unknown; use none or salaad"),
        (["pretrain", *SALAAD, "--set", "salaad.every=0", "--set", "run_dir=o"],
         "salaad.every=0 must be an int >= 1"),
        (["pretrain", *SALAAD, "--set", "salaad.kI_alpha=nan", "--set", "run_dir=o"],
         "salaad.kI_alpha='nan' must be a number"),
    ],
}
PARAMS = [pytest.param(argv, message, id=f"{command}: {' '.join(argv[1:])}"[:90])
          for command, cases in CASES.items() for argv, message in cases]


@pytest.mark.parametrize("argv, message", PARAMS)
def test_new_command_faults_are_one_clear_line(faults, inputs, argv, message):
    faults.expect_error(argv, message, out=inputs.parent / "o")
    assert not (inputs.parent / "o.npy").exists()  # select wrote nothing


def test_a_dying_process_under_launch_stops_the_others(faults, inputs):
    """One process of two fails (a user error in the command): launch stops the other and
    says which one failed, in one line after the process's own (prefixed) line."""
    code, out, err = faults.cli(["launch", "--processes", "2", "--devices-per-process", "1",
                                 "--", "plan", "--devices", "0"])
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("lowrank-jax launch: error: process ")
    assert "exited with status 2; the other processes were stopped" in lines[-1]
    assert any("--devices=0 must be a positive integer" in line for line in out.splitlines()
               + lines), (out, err)
    faults.clear_error()


def test_export_of_a_run_without_salaad_state(faults, tiny_runs, tmp_path):
    faults.expect_error(["export", "--run", tiny_runs["split"], "--budget", "0.5", "--out",
                         tmp_path / "o"], "the run was trained with structure='none', so it "
                                          "has no SALAAD state", out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_export_writes_a_model_of_the_budget(faults, salaad_run, tmp_path):
    code, out, err = faults.cli(["export", "--run", salaad_run, "--budget", "0.5", "--out",
                                 tmp_path / "o"], out=tmp_path / "o")
    assert code == 0, err
    report = json.loads((tmp_path / "o" / "salaad.json").read_text())
    assert report["params"] <= report["target_params"] == int(0.5 * report["dense_params"])
    faults.recovered()
