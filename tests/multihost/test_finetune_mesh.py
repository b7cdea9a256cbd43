"""``finetune --mesh`` in one process of 8 devices against one device (slow tier: the default
run checks LoRA on the mesh across 2 processes in test_pretrain_processes.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from lowrank_jax.cli import main as cli_main


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--quantize", "nf4"], ["--method", "balora"]])
def test_finetune_on_a_mesh_matches_one_device(tmp_path, extra):
    command = ["finetune", "--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len",
               "16", "--rank", "4", "--no-progress", *extra]
    assert cli_main(command + ["--out", str(tmp_path / "one")]) == 0
    assert cli_main(command + ["--out", str(tmp_path / "mesh"), "--mesh", "data=2,fsdp=4"]) == 0
    losses = [json.loads((tmp_path / run / "losses.json").read_text()) for run in ("one", "mesh")]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    adapters = [load_file(tmp_path / run / "adapter" / "adapter_model.safetensors")
                for run in ("one", "mesh")]
    assert sorted(adapters[0]) == sorted(adapters[1])
    for key, value in adapters[0].items():
        np.testing.assert_allclose(adapters[1][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
