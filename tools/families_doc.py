"""Print the MoE families Mira runs, as the README lists them: the families whose every case in
tests/e2e/test_moe_families.py passes.

    python tools/families_doc.py                 # runs the family tests (CPU, a few minutes)
    python tools/families_doc.py --junit FILE    # reads a JUnit XML report of a run of them
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mira.models.interface import moe_families  # noqa: E402
TEST = "tests/e2e/test_moe_families.py"
CASE = re.compile(r"^(?P<test>\w+)\[(?P<family>[\w.-]+)\]$")


def outcomes(junit: Path) -> dict[str, dict[str, bool]]:
    """family -> {test name: passed} from a JUnit XML report of the family tests."""
    results: dict[str, dict[str, bool]] = defaultdict(dict)
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        match = CASE.match(case.get("name", ""))
        if match is None or not case.get("classname", "").endswith("test_moe_families"):
            continue
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        results[match["family"]][match["test"]] = not failed
    return results


def passing(results: dict[str, dict[str, bool]]) -> list[str]:
    return sorted(family for family, tests in results.items() if tests and all(tests.values()))


def run_tests(junit: Path) -> None:
    subprocess.run([sys.executable, "-m", "pytest", "-q", TEST, f"--junitxml={junit}"], cwd=ROOT, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="a JUnit XML report of the family tests (default: run them)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        junit = args.junit
        if junit is None:
            junit = Path(scratch) / "families.xml"
            run_tests(junit)
        results = outcomes(junit)
    families = passing(results)
    classes = {family.model_type: family.model_class for family in moe_families()}
    print("`config.json` `model_type` | transformers class")
    print("--- | ---")
    for family in families:
        print(f"`{family}` | {classes.get(family, '')}")
    failing = sorted(set(results) - set(families))
    if failing:
        print(f"\nnot passing: {', '.join(failing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
