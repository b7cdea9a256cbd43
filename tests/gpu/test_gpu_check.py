"""`scripts/gpu/check.sh` runs end to end on a CPU (Pallas interpret mode, tiny sizes)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPECTED = {"check_flash_correctness", "check_sale_correctness", "bench_attention",
            "check_grouped_lora", "check_lattice_matmul", "check_subspace_attention",
            "check_xkv_decode"}


def test_check_sh_dry_run_checks_every_kernel_against_its_reference(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu/check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["meta"]["dry_run"] is True and record["meta"]["jax"]
    results = record["results"]
    assert set(results) == EXPECTED
    errors = []
    for name, result in results.items():
        assert result["ok"], (name, result)
        for r in result["rows"]:
            errors += [v for k, v in r.items() if "rel_err" in k and k != "rel_err_vs_dense"]
    assert errors and max(errors) < 1e-5  # fp32 interpret mode: kernels equal their references
    log = (tmp_path / "gpu_check.log").read_text()
    assert "check_lattice_matmul: ok=True" in log and "wrote" in log


def test_device_checks_share_one_timer():
    sources = list((ROOT / "scripts/gpu").rglob("*.py"))
    assert len(sources) >= 6
    own_timers = [p.name for p in sources if "perf_counter" in p.read_text()]
    assert own_timers == [], f"own timers instead of lowrank_jax.bench.time_fn: {own_timers}"
