"""The README's and the docs pages' Python examples run as written and do what the text around
them says: every block either asserts its own result or has a check here.

The blocks of one file run in order in one namespace, inside a temporary working directory (so
``runs/...`` paths written by an example land there).
"""

import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md")
                   if "_build" not in p.parts and "results" not in p.parts)


def _check_lora(ns):
    # "apply_lora swaps matching nnx.Linear layers": the q and v projections of both layers.
    assert ns["paths"] == [f"layers/{i}/self_attn/{p}_proj" for i in (0, 1) for p in ("q", "v")]
    assert np.isfinite(float(ns["loss"]))
    # the optimizer trained only the adapters: B left zero-init, then merge_lora folded s·A·B in
    assert not np.allclose(np.asarray(ns["after"]), np.asarray(ns["model"](ns["tokens"])[0]))


def _check_spectron(ns):
    from flax import nnx

    from lowrank_jax.optim import find_pairs

    state = nnx.state(ns["model"], nnx.Param)
    assert len(find_pairs(state, kinds=("factor",))) == 14  # 7 factorized projections x 2 layers
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


def _check_user_model(ns):
    from flax import nnx
    from safetensors.numpy import load_file

    from lowrank_jax.optim import find_pairs

    losses = ns["user_losses"]
    assert len(losses) == 20 and losses[-1] < losses[0]  # the adapters trained
    tensors = load_file("runs/user_adapter/adapter_model.safetensors")
    q_b = [k for k in tensors if "self_attn.q_proj" in k and "lora_B" in k]
    assert len(q_b) == 1 and tensors[q_b[0]].shape == (64, 4)  # [N*H, r], as the comment says
    assert set(ns["nf4_errors"]) == {"o_proj", "q_proj", "up_proj", "v_proj"}  # r"proj" matched
    assert {r["rank"] for r in ns["report"].values()} == {32}  # rank ratio 0.5 of 64
    assert len(find_pairs(nnx.state(ns["low_rank"], nnx.Param), kinds=("factor",))) == 4


CHECKS = {  # a distinctive line of the block -> the check of what the text promises
    'LoRARule(r"self_attn/(q|v)_proj"': _check_lora,
    'spectron(0.02)': _check_spectron,
    "export_peft(model, folder": _check_peft,
    "quantize_projections(qblock": _check_user_model,
}


def _run_blocks(path: pathlib.Path) -> set:
    """Run the python blocks of ``path`` in order; return the checks that ran."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    namespace: dict = {}
    checked = set()
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{path.name} python block {i}", "exec"), namespace)
        except Exception as error:  # name the block that broke
            raise AssertionError(f"{path.name} python block {i} failed: {error!r}\n{block}") \
                from error
        checks = [fn for marker, fn in CHECKS.items() if marker in block]
        for fn in checks:
            fn(namespace)
            checked.add(fn)
        assert checks or re.search(r"^\s*assert ", block, flags=re.M), (
            f"{path.name} python block {i} neither asserts its result nor has a check in "
            f"tests/test_readme.py:\n{block}"
        )
    jax.clear_caches()
    return checked


def test_readme_python_blocks_run_and_their_results_are_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run_blocks(README) == {_check_user_model}, "README's own-model example is gone"


def test_docs_examples_are_all_checked():
    markers = "".join(p.read_text() for p in DOC_PAGES)
    missing = [m for m, fn in CHECKS.items() if fn is not _check_user_model and m not in markers]
    assert not missing, f"docs examples the checks expect are gone: {missing}"
    assert sum(p.read_text().count("```python") for p in DOC_PAGES) >= 20


@pytest.mark.parametrize("page", [p for p in DOC_PAGES if "```python" in p.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_docs_page_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run_blocks(page)
