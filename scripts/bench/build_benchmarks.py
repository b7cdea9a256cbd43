"""Assemble BENCHMARKS.md from the per-topic result notes in docs/results/ (run after a script)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
ORDER = ["main_job", "bench", "spectron", "real_checkpoints", "sharding", "lora_toolkit",
         "continual",
         "loda", "crispedit", "attention_kernels", "xkv", "unisvq", "plora", "analysis"]

HEADER = """# Benchmarks and reproductions

Every number here was measured by a script in `scripts/` that runs the method **and its
baseline in the same run**; the command is given with each table. Machine: CPU, 2 cores, shared
with other jobs while these ran (load averages of 8–25), so absolute seconds are inflated and only
same-run ratios should be compared. No GPU/TPU was lent in the sessions so far: there are no
device timings yet (`scripts/gpu/check.sh` is ready for one). Date of all runs: 2026-11-29.

"""


def main():
    notes = ROOT / "docs" / "results"
    names = [n for n in ORDER if (notes / f"{n}.md").exists()]
    names += sorted(p.stem for p in notes.glob("*.md") if p.stem not in ORDER)
    parts = [HEADER, "Contents: " + ", ".join(f"[{n}](#{n})" for n in names) + "\n"]
    for name in names:
        text = (notes / f"{name}.md").read_text().replace("](../img/", "](docs/img/")
        body = text.split("\n", 1)
        title = body[0].lstrip("# ").strip()
        parts.append(f'\n<a id="{name}"></a>\n\n## {title}\n\n' + (body[1] if len(body) > 1 else "")
                     .replace("\n## ", "\n### ").replace("\n### #", "\n#### "))
    (ROOT / "BENCHMARKS.md").write_text("".join(parts))
    print(f"wrote BENCHMARKS.md from {len(names)} notes")


if __name__ == "__main__":
    main()
