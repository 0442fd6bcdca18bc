"""Check committed `mira bench` results against the residency goals: in every cell `mira` decodes
at least 0.97x the fastest baseline's median; on real routing it beats every baseline with
achieved/bound at most 1.5.

    python benchmarks/goals.py benchmarks/results/bench-*.json

Prints one line per cell and exits non-zero when a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mira.bench.run import compare

AT_LEAST_BEST_BASELINE = 0.97
REAL_ROUTING_BOUND = 1.5


def cells(result: dict) -> list[tuple[str, bool, str]]:
    """(cell, met, figures) for every budget of one result."""
    real = "replayed" in result.get("routing", "") or result.get("routing") == "real"
    out = []
    for budget, c in compare(result["runs"]).items():
        ratio, bound = c["mira_over_best_baseline"], c["mira_achieved_over_bound"]
        met = ratio >= (1.0 if real else AT_LEAST_BEST_BASELINE)
        if real:
            met = met and bound is not None and bound <= REAL_ROUTING_BOUND
        out.append((f"{result['model']} {budget}", met,
                    f"mira {c['mira']:.3g} / {c['best_baseline']} {c['best_baseline_tokens_per_s']:.3g} = {ratio:.3f}x, "
                    f"achieved/bound {bound}"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="mira bench JSON files")
    args = parser.parse_args()
    missed = 0
    for path in args.results:
        result = json.loads(path.read_text())
        if "runs" not in result:
            continue
        for cell, met, figures in cells(result):
            missed += not met
            print(f"{'met   ' if met else 'MISSED'} {cell}: {figures}  ({path.name})")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
