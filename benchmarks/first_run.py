"""Wall time of the README's generate command on a fresh cache (issue #3: under 30 s on a CPU).

Runs `mira generate --prompt "How do I sort a list in Python?" --max-new-tokens 40` in a new process
with an empty MIRA_CACHE, so the bundled model is converted on first use, and records the wall
time, the text and the run's statistics.

    python benchmarks/first_run.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
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
    result = {**result_header("python benchmarks/first_run.py"), "runs": " ".join(command[1:]), "figures": figures}
    (ROOT / "benchmarks" / "results" / "first-run-cpu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
