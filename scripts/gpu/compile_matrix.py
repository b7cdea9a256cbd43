"""Every public Pallas op on every target, from this (CPU) host: the op × target table.

Each op's ``pallas_kernels/<op>/cases.py`` lists its entry points at production shapes (an
8B-class layer) and small odd shapes; every case is compiled for TPU v5e / v5p / v6e by libtpu
and lowered for H100 / H200 by ``jax.export`` (:func:`pallas_kernels.aot.check_case`). A cell
passes when the compiler accepts the module *and* a Pallas kernel is in it (an XLA fallback
fails). The table shows, per cell, ``ok`` with the kernel count (TPU: and the per-device
argument / temp bytes of the compiled module) or the first line of the error; the JSON has
every number. TPU targets need libtpu (``pip install -e ".[tpu]"``).

Usage::

    python -m scripts.gpu.compile_matrix                         # production, all targets
    python -m scripts.gpu.compile_matrix --size small --targets v5e h200
    python -m scripts.gpu.compile_matrix --ops flash_attention --out runs/compile_matrix
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import jax

from pallas_kernels import aot

OPS = ("flash_attention", "sparse_attention", "subspace_attention", "xkv_decode",
       "grouped_lora", "lattice_matmul")
TARGETS = ("v5e", "v5p", "v6e", "h100", "h200")


def _bytes(n: int) -> str:
    """``n`` bytes as ``"12K"``, ``"340M"``, ``"1.1G"``."""
    if n >= 2 ** 30:
        return f"{n / 2 ** 30:.1f}G"
    return f"{n / 2 ** 20:.0f}M" if n >= 2 ** 20 else f"{n / 2 ** 10:.0f}K"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:160]


def run_matrix(ops, sizes, targets) -> list[dict]:
    """One row per (case, target): ``ok``, kernels, memory or the error, seconds."""
    rows = []
    for op in ops:
        for size in sizes:
            try:
                cases = importlib.import_module(f"pallas_kernels.{op}.cases").compile_cases(size)
            except Exception as err:  # noqa: BLE001 - an op without cases is a failed row
                rows.append({"op": op, "entry": "cases", "size": size, "target": "-",
                             "ok": False, "error": _first_line(err)})
                continue
            for case in cases:
                for target in targets:
                    if target not in case.targets:
                        continue
                    row = {"op": op, "entry": case.entry, "size": size, "case": case.name,
                           "target": target, "gpu_backend": case.gpu_backend}
                    start = time.time()
                    try:
                        row.update(aot.check_case(case, target), ok=True)
                    except Exception as err:  # noqa: BLE001 - recorded, the others still run
                        row.update(ok=False, error=_first_line(err))
                    row["seconds"] = round(time.time() - start, 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def cell(row: dict) -> str:
    """The table text of one row."""
    if not row["ok"]:
        return row["error"][:60]
    text = f"ok ({row['kernels']})"
    if "temp_bytes" in row:
        text += f" arg {_bytes(row['argument_bytes'])} tmp {_bytes(row['temp_bytes'])}"
    return text


def print_table(rows: list[dict], targets) -> str:
    """The op × target table (one line per case), as printed; returns the markdown."""
    cases = []
    for row in rows:
        key = (row["op"], row["entry"], row.get("case", row["size"]))
        if key not in cases:
            cases.append(key)
    header = "| op | entry | shapes | " + " | ".join(targets) + " |"
    lines = [header, "|" + "---|" * (3 + len(targets))]
    for op, entry, name in cases:
        cells = []
        for target in targets:
            hit = [r for r in rows if (r["op"], r["entry"], r.get("case", r["size"])) ==
                   (op, entry, name) and r["target"] in (target, "-")]
            cells.append(cell(hit[0]) if hit else "")
        shapes = name[name.find("[") + 1:-1] if "[" in name else name
        lines.append(f"| {op} | {entry} | {shapes} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print("\n" + text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    parser.add_argument("--size", default="production", choices=("production", "small", "all"))
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/compile_matrix"))
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")
    sizes = ("production", "small") if args.size == "all" else (args.size,)
    rows = run_matrix(args.ops, sizes, args.targets)
    table = print_table(rows, args.targets)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "sizes": list(sizes), "targets": list(args.targets)}
    (out / "compile_matrix.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "compile_matrix.md").write_text(table + "\n")
    passed = sum(r["ok"] for r in rows)
    print(f"\n{passed} / {len(rows)} cells pass; wrote {out / 'compile_matrix.json'}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
