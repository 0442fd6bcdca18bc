"""Wall time of the README's generate command on a fresh cache (issue #3: under 30 s on a CPU).

Runs `mira generate --prompt "How do I sort a list in Python?" --max-new-tokens 40` in a new process
with an empty MIRA_CACHE, so the bundled model is converted on first use, and records the wall
time, the text and the run's statistics.

    python benchmarks/first_run.py [--out benchmarks/results/first-run-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mira.bench.provenance import result_header
from mira.store.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "first-run-cpu.json",
                        help="the JSON result to write (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        stats = Path(cache) / "stats.json"
        command = [sys.executable, "-m", "mira.cli", "generate", "--prompt", "How do I sort a list in Python?",
                   "--max-new-tokens", "40", "--device", "cpu", "--stats-json", str(stats)]
        start = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "MIRA_CACHE": cache})
        wall = time.perf_counter() - start
        if run.returncode:
            raise SystemExit(run.stderr)
        figures = {"wall_s": wall, "text": run.stdout.strip(), "stats": json.loads(stats.read_text())}
    print(f"{wall:.1f} s in total\n{figures['text']}")
    command_line = " ".join(["python benchmarks/first_run.py", *sys.argv[1:]])
    write_json_atomic(args.out, {**result_header(command_line), "runs": " ".join(command[1:]), "figures": figures})


if __name__ == "__main__":
    main()
