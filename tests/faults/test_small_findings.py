"""Issue 51, finding 9: the smaller ones (the marker-only folder is in test_output_rule.py).

- ``generate --kv xkv --kv-ratio 1000`` on a 2-layer model blamed "the default 4" of
  ``--kv-group``, which the user never set: the unset group now fits the model, and the line
  is about the ratio;
- ``launch -- notacommand`` advised ``--resume``;
- ``select --rank 50`` on 8-dimensional embeddings was accepted (every row in the subspace,
  Lipschitz 1e13).
"""

from __future__ import annotations

import numpy as np


def test_kv_ratio_error_does_not_blame_an_unset_group(faults):
    line = faults.expect_error(["generate", "--model", "tiny", "--prompt", "hello", "--raw",
                                "--kv", "xkv", "--kv-ratio", "1000", "--max-new-tokens", "2"],
                               "ratio=1000.0 cannot be met for a group of 2 layers")
    assert "default 4" not in line


def test_kv_group_larger_than_the_model_names_the_flag(faults):
    faults.expect_error(["generate", "--model", "tiny", "--prompt", "hello", "--raw", "--kv",
                         "xkv", "--kv-group", "4"],
                        "--kv-group 4 exceeds the model's 2 layers; pass --kv-group between 1 "
                        "and 2")


def test_launch_of_an_unknown_command_names_it_without_resume_advice(faults):
    line = faults.expect_error(["launch", "--processes", "2", "--", "notacommand"],
                               "launch: 'notacommand' is not a lowrank-jax command; put one of "
                               "analyze, bench")
    assert "--resume" not in line


def test_launch_status_2_is_not_advised_resume():
    """The launcher's reason for a process that exited 2 (a user error) says to fix it."""
    import sys

    from lowrank_jax.train.multihost import launch

    status, why = launch([sys.executable, "-c", "import sys; sys.exit(2)"], processes=1,
                         devices_per_process=1)
    assert status == 2
    assert why.endswith("say why; fix what they name and run again.") and "--resume" not in why


def test_select_rank_at_or_above_the_dimension_is_refused(faults, tmp_path):
    emb = tmp_path / "emb.npy"
    np.save(emb, np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32))
    line = faults.expect_error(["select", "--embeddings", emb, "--budget", "4", "--rank", "50",
                                "--out", tmp_path / "o.npy"],
                               "--rank 50 must be below min(rows, dimension) = 8")
    assert "pass --rank 7 or less" in line
    assert not (tmp_path / "o.npy").exists()


def test_select_default_rank_fits_small_embeddings(faults, tmp_path):
    emb = tmp_path / "emb.npy"
    np.save(emb, np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32))
    out = tmp_path / "o.npy"
    code, stdout, err = faults.cli(["select", "--embeddings", emb, "--budget", "4", "--out",
                                    out], out=tmp_path)
    assert code == 0, err
    assert "rank=7," in stdout
    lipschitz = float(stdout.split("lipschitz=")[1].split(",")[0])
    assert lipschitz < 1e3  # residuals are not zero: a finite, sane constant
    faults.recovered()
