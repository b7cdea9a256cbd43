"""The README's Python examples run as written (in order, sharing one namespace) and do what the
text around them says: every block either asserts its own result or has a check here."""

import json
import os
import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _check_lora(ns):
    # "apply_lora swaps matching nnx.Linear layers": the q and v projections of both layers.
    assert ns["paths"] == [f"layers/{i}/self_attn/{p}_proj" for i in (0, 1) for p in ("q", "v")]
    assert np.isfinite(float(ns["loss"]))
    # the optimizer trained only the adapters: B left zero-init, then merge_lora folded s·A·B in
    assert not np.allclose(np.asarray(ns["after"]), np.asarray(ns["model"](ns["tokens"])[0]))


def _check_spectron(ns):
    from flax import nnx

    from lowrank_jax.optim import factor_pairs

    state = nnx.state(ns["model"], nnx.Param)
    assert len(factor_pairs(state)) == 14  # 7 factorized projections x 2 layers
    assert int(ns["optimizer"].step[...]) == 1 and np.isfinite(float(ns["loss"]))


def _check_peft(ns):
    from safetensors.numpy import load_file

    folder = ns["folder"]
    config = json.loads((pathlib.Path(folder) / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"].endswith("SmolLM2-135M-Instruct")
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    assert tensors[key].shape == (4, 64)  # [rank, in], as the comment says
    assert len(tensors) == 2 * 3 * 2  # A and B for gate/up/down in 2 layers


CHECKS = {  # a distinctive line of the block -> the check of what the text promises
    'LoRARule(r"self_attn/(q|v)_proj"': _check_lora,
    'spectron(0.02)': _check_spectron,
    "export_peft(model, folder": _check_peft,
}


def test_readme_python_blocks_run_and_their_results_are_checked():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5, "README lost its runnable examples"
    namespace: dict = {}
    checked = set()
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as error:  # name the block that broke
            raise AssertionError(f"README python block {i} failed: {error!r}\n{block}") from error
        checks = [fn for marker, fn in CHECKS.items() if marker in block]
        for fn in checks:
            fn(namespace)
            checked.add(fn)
        assert checks or re.search(r"^\s*assert ", block, flags=re.M), (
            f"README python block {i} neither asserts its result nor has a check in "
            f"tests/test_readme.py:\n{block}"
        )
    assert checked == set(CHECKS.values()), "a README example the checks expect is gone"
    jax.clear_caches()
