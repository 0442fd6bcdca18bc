"""How long `mira --help`, a command's `--help` and a refused argument take, each in a fresh process.

Each case runs `python -c "...main(ARGS)"` in the tree measured (its mira first on sys.path), `--repeats`
times after one untimed run (which warms the file cache), and reports the median and range of the
wall time. With `--baseline DIR` (a checkout of another commit, e.g. `git worktree add /tmp/base
COMMIT`) every case runs there too, in turns with this tree, and the table gives this tree's
median over the baseline's.

    python benchmarks/cli_start.py --baseline /tmp/base --out benchmarks/results/cli-start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import result_header  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402

CASES = {  # name -> the arguments of `mira`
    "mira --help": ["--help"],
    "mira generate --help": ["generate", "--help"],
    "mira bench --help": ["bench", "--help"],
    "mira simulate --help": ["simulate", "--help"],
    "mira generate --top-p 2 (refused)": ["generate", "--top-p", "2"],
}
RUN = "import sys; from mira.cli import main; sys.exit(main(sys.argv[1:]))"


def _seconds(tree: Path, argv: list[str]) -> float:
    """Wall time of one `mira argv` in a fresh interpreter importing `tree`'s mira."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", RUN, *argv], env=env, cwd=tree, capture_output=True, check=False)
    return time.perf_counter() - begin


def _imported_from(tree: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", "import mira; print(mira.__file__)"], env=env, cwd=tree,
                          capture_output=True, text=True, check=True).stdout.strip()


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="a checkout of the commit to compare against")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case and tree (default 5)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cli-start.json")
    args = parser.parse_args()

    trees = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    for label, tree in trees.items():
        if not _imported_from(tree).startswith(str(tree)):
            sys.exit(f"{label}: a process in {tree} does not import its own mira")
    times: dict[str, dict[str, list[float]]] = {case: {label: [] for label in trees} for case in CASES}
    for case, argv in CASES.items():
        for tree in trees.values():
            _seconds(tree, argv)  # untimed: the file cache warm for both
        for _ in range(args.repeats):
            for label, tree in trees.items():  # in turns, so a slower minute costs both alike
                times[case][label].append(_seconds(tree, argv))

    figures = {}
    for case, by_tree in times.items():
        figures[case] = {label: {"median_s": round(statistics.median(runs), 3),
                                 "range_s": [round(min(runs), 3), round(max(runs), 3)]} for label, runs in by_tree.items()}
        if args.baseline:
            figures[case]["over_baseline"] = round(statistics.median(by_tree["this tree"])
                                                   / statistics.median(by_tree["baseline"]), 3)
    result = {**result_header(" ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])),
              **({"baseline_commit": _commit(args.baseline)} if args.baseline else {}),
              "repeats": args.repeats, "how": "wall time of a fresh `python -c` running mira.cli.main, "
                                              "after one untimed run per case and tree", "cases": figures}
    write_json_atomic(args.out, result)

    labels = list(trees)
    print(f"{'case':38}" + "".join(f"{label + ' (s)':>16}" for label in labels) + ("  this/baseline" if args.baseline else ""))
    for case, row in figures.items():
        cells = "".join(f"{row[label]['median_s']:>16.3f}" for label in labels)
        print(f"{case:38}{cells}" + (f"{row['over_baseline']:>15.3f}" if args.baseline else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
