"""The house rules of issue 37, counted from the source by ``scripts/house_counts.py``.

The script is run as a program (tests never import ``scripts/``); its ``--json`` output is checked
against the targets already reached, so a new import circle, an upward arrow, a private-name
import or a kernel op without ``BlockSizes`` fails here.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def counts():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "house_counts.py"), "--json"],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)


def test_counts_see_the_package(counts):
    # the counter reads real source: the kernels are there and the known steps are found
    assert {"flash_attention", "grouped_lora", "lattice_matmul"} <= set(counts["ops"])
    assert any("train/loop.py" in s for s in counts["steps"])
    assert any("train/losses.py" in s for s in counts["nll"])


def test_no_import_circles(counts):
    assert counts["circles"] == []
