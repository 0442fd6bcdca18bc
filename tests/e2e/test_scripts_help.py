"""Every script under benchmarks/ and tools/ answers --help: its imports resolve (its own folder
first on sys.path, as `python DIR/x.py` has it) and it parses its arguments before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(path) for folder in ("benchmarks", "tools") for path in (ROOT / folder).glob("*.py")
                 if 'if __name__ == "__main__":' in path.read_text())  # not the modules they share

# each script run as __main__ with --help in one interpreter (the imports are paid once); a script's
# folder is sys.path[0] while it runs, as when it is started on its own
RUNNER = """
import io, json, runpy, sys, contextlib
failures = {}
for script in json.loads(sys.argv[1]):
    sys.argv, sys.path[0] = [script, "--help"], script.rsplit("/", 1)[0]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
        failures[script] = "returned without printing help and exiting"
    except SystemExit as exit:
        if exit.code not in (0, None):
            failures[script] = f"exit {exit.code}"
    except BaseException as error:
        failures[script] = repr(error)[:300]
print(json.dumps(failures))
"""


def test_every_script_answers_help(tmp_path):
    assert len(SCRIPTS) > 10
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    env["MIRA_CACHE"] = str(tmp_path)  # a script that works instead of answering leaves no store behind
    run = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(SCRIPTS)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    failures = json.loads(run.stdout.strip().splitlines()[-1])
    assert failures == {}
