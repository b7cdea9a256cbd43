"""Run the fault-injection suite (tests/faults/) and print its reliability table as Markdown.

Each test of the suite injects one fault (a bad value, a damaged checkpoint, a full disk, an
occupied output folder, ...) and records what the command did; the suite's conftest counts the
outcomes. This script runs it and prints the table quoted in README.md ("Reliability")::

    python scripts/faults_table.py            # about 2-4 minutes on 2 CPU cores
    python scripts/faults_table.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the table and outcomes here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = pathlib.Path(tmp) / "faults.json"
        env = dict(os.environ, LOWRANK_FAULTS_JSON=str(result_path))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(ROOT / "tests" / "faults")], cwd=ROOT, env=env, check=False)
        if not result_path.exists():
            print("the fault suite did not run (see the pytest output above)", file=sys.stderr)
            return proc.returncode or 1
        data = json.loads(result_path.read_text())
    print("\n| outcome | count |\n|---|---:|")
    for key, value in data["table"].items():
        print(f"| {key} | {value} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(data, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
