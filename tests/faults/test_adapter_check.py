"""Issue 51, finding 7: one adapter check for every command that reads an adapter.

``generate --adapter`` served a truncated file as an internal error, a config saying ``r: 16``
over rank-4 tensors and an adapter with no tensors silently; ``merge`` refused all three. Now
both (and ``--model ADAPTER``, ``import_peft`` and ``export_peft``) go through
:func:`lowrank_jax.io.adapters.read_adapter`: one line, exit 2, the same reason."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.xdist_group("faults.test_adapter_check")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A rank-4 PEFT adapter of the tiny model."""
    from flax import nnx

    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.nn import apply_lora

    model = preset_model("tiny")
    apply_lora(model, {"q_proj": 4}, rngs=nnx.Rngs(1))
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    export_peft(model, folder, base_model_name_or_path="tiny")
    return folder


def _truncated(folder):
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def _rank_16(folder):
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = 16
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _no_tensors(folder):
    from safetensors.numpy import save_file

    save_file({}, str(folder / "adapter_model.safetensors"))


DAMAGE = {
    "truncated safetensors": (_truncated, "adapter_model.safetensors is not a readable "
                                          "safetensors file"),
    "config r over rank-4 tensors": (_rank_16, "stores rank 4 but adapter_config.json says "
                                               "r=16"),
    "no tensors": (_no_tensors, "adapter_model.safetensors holds no tensors, so the adapter "
                                "would change nothing"),
}


def _argv(command, folder, out):
    if command == "generate":
        return ["generate", "--model", "tiny", "--adapter", folder, "--prompt", "hi"]
    if command == "merge":
        return ["merge", "--model", "tiny", "--adapter", folder, "--to", "fp", "--out", out]
    return ["generate", "--model", folder, "--prompt", "hi"]  # the adapter as --model


@pytest.mark.parametrize("command", ["generate", "merge", "--model ADAPTER"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_reader_refuses_a_broken_adapter_alike(faults, adapter, tmp_path, command,
                                                     damage):
    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    damage_fn, message = DAMAGE[damage]
    damage_fn(folder)
    faults.expect_error(_argv(command, folder, tmp_path / "merged"), message)
    assert not (tmp_path / "merged").exists()


def test_export_checks_what_it_wrote_before_replacing_the_old_adapter(faults, adapter,
                                                                      tmp_path, monkeypatch):
    """A writer that produced a broken file (here: no tensors) never replaces a good
    adapter: export_peft reads its output back with the same check first."""
    import safetensors.numpy
    from flax import nnx

    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.models.presets import preset_model
    from lowrank_jax.nn import apply_lora

    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = safetensors.numpy.save_file
    monkeypatch.setattr(safetensors.numpy, "save_file",
                        lambda tensors, path, **kw: real({}, path, **kw))
    model = preset_model("tiny")
    apply_lora(model, {"q_proj": 4}, rngs=nnx.Rngs(2))
    with pytest.raises(ValueError, match="holds no tensors"):
        export_peft(model, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary left
    faults.clear_error()
