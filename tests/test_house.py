"""The house rules of issue 37, counted from the source by ``scripts/house_counts.py``.

The script is run as a program (tests never import ``scripts/``); its ``--json`` output is checked
against the targets already reached, so a new import circle, an upward arrow, a private-name
import or a kernel op without ``BlockSizes`` fails here.
"""

import dataclasses
import importlib
import json
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels import _dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]


# its module-scoped fixture (a run of house_counts.py) is built once: one worker runs the file
pytestmark = pytest.mark.xdist_group("test_house")


@pytest.fixture(scope="module")
def counts():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "house_counts.py"), "--json"],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)


def test_counts_see_the_package(counts):
    # the counter reads real source: the kernels are there and the known steps are found
    assert {"flash_attention", "grouped_lora", "lattice_matmul"} <= set(counts["ops"])
    assert any("core/step.py" in s for s in counts["steps"])
    assert any("core/losses.py" in s for s in counts["nll"])


def test_no_import_circles(counts):
    # 41 modules were in one circle through the package __init__s before the floors pass
    assert counts["circles"] == [], counts["circles"]


def test_no_upward_arrows(counts):
    assert counts["upward"] == [], counts["upward"]


def test_ground_floor_imports_nothing_above(counts):
    # core/ is the ground: a circle or upward arrow from it would show above; also check that the
    # shared maths moved there (the optimizers' linalg is a re-export of core.linalg)
    core = ROOT / "lowrank_jax" / "core"
    for path in core.glob("*.py"):
        text = path.read_text()
        for line in text.splitlines():
            if line.lstrip().startswith(("from lowrank_jax", "import lowrank_jax")):
                assert "lowrank_jax.core" in line, f"{path.name}: {line.strip()}"
    assert (core / "linalg.py").is_file() and (core / "kruskal.py").is_file()


def test_no_private_imports(counts):
    # 22 before issue 37's floors pass, 11 after it; what one module uses of another is public
    assert counts["private"] == [], counts["private"]


def test_the_package_has_one_training_step(counts):
    # issue 37: every library trainer builds its step with core.step.make_step (7 steps before)
    package = [s for s in counts["steps"] if s.startswith("lowrank_jax/")]
    assert [s.split(" ")[0].rsplit(":", 1)[0] for s in package] == ["lowrank_jax/core/step.py"], \
        package


def test_the_package_and_scripts_have_one_training_loop(counts):
    # issue 52: 17 loops over steps (train_steps, train_windows, pretraining, finetune, jobs,
    # class-incremental x2, hyper x2, LoRDO x2, UniSVQ, e2e, editing, video DiT, lockstep, the
    # scaling-law script) before core.loop; every trainer now runs its steps there
    assert counts["loops"] == [s for s in counts["loops"] if "core/loop.py" in s], counts["loops"]
    assert len(counts["loops"]) == 1 and counts["loops"][0].endswith(" iterate_steps")


def test_every_kernel_op_has_block_sizes(counts):
    # 2 of 6 before issue 37's tiling pass; one policy in pallas_kernels/_dispatch.py
    assert len(counts["ops"]) == 6 and counts["ops_missing_block_sizes"] == [], counts


def test_every_block_sizes_follows_the_one_policy():
    for op in ("flash_attention", "grouped_lora", "lattice_matmul", "sparse_attention",
               "subspace_attention", "xkv_decode"):
        tiles = importlib.import_module(f"pallas_kernels.{op}").BlockSizes
        assert issubclass(tiles, _dispatch.TileSizes) and tiles.get_default() == tiles(), op
        first = dataclasses.fields(tiles)[0].name
        with pytest.raises(ValueError, match=rf"BlockSizes.{first}=12 must be a power of two"):
            tiles(**{first: 12})


def test_scripts_shrank_by_at_least_1500_lines(counts):
    # issue 37 acceptance 2: library logic moves out of scripts/ (8,090 lines when it began)
    assert 1000 < counts["script_lines"] <= 8090 - 1500, counts["script_lines"]


def test_one_adapter_body(counts):
    # issue 52: LoRA, QLoRA, LoRA over any projection, LoKRA and the hypernetwork's adapters all
    # apply lowrank_jax.nn.lora.lora_output (3 bodies before: LoRA, LoKRA, the hypernetwork's)
    assert [s.split(" ")[-1] for s in counts["adapter_bodies"]] == ["lora_output"], \
        counts["adapter_bodies"]


def test_one_dense_weight_accessor(counts):
    # issue 52: dense_matrix (function and layer methods of that name); before: dense_matrix,
    # kernel_matrix, dense_weight, _dense_kernel
    assert list(counts["dense_accessors"]) == ["dense_matrix"], counts["dense_accessors"]


def test_one_pair_finder(counts):
    # issue 52: find_pairs; before: find_pairs, factor_pairs, lora_pairs, label_factors,
    # find_lora_pairs, lora_pair_paths, weight_pairs
    assert list(counts["pair_finders"]) == ["find_pairs"], counts["pair_finders"]


def test_no_homonyms(counts):
    # issue 52: 35 public names were defined in two or more modules when the count began; each
    # public name now has one meaning (KV_METHODS, QUANT_METHODS, FINETUNE_METHODS, ...,
    # project_to_subspaces / project_update, evaluate_edits, select_benchmarks)
    assert counts["homonyms"] == {}, counts["homonyms"]


def test_every_package_folder_is_a_regular_package():
    # lowrank_jax/runs/__init__.py (the face) was once kept out of the repository by the
    # .gitignore line for run folders: a fresh clone then had `lowrank_jax.runs` as a namespace
    # package, with no face and no doctests of its modules. Every folder of Python modules in
    # the two packages holds its __init__.py, so a clone (CI) fails here when one is missing.
    folders = {p.parent for package in ("lowrank_jax", "pallas_kernels")
               for p in (ROOT / package).rglob("*.py")}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert missing == [], f"folders of modules without __init__.py: {missing}"
    assert len(folders) > 20


def test_commands_import_the_names_a_face_exports_through_the_face(counts):
    # issue 52: 18 such deep imports before (from lowrank_jax.train.config import load_config, ...)
    assert counts["deep_imports"] == [], counts["deep_imports"]
