"""The decode GEMV launches' machine code, compiled for Hopper without a GPU (tools/kernel_sass.py):
the tuned launches broadcast the activation vector through shared memory, with barriers in the loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "kernel_sass.py"


def test_tuned_decode_launches_broadcast_through_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests' interpreter would replace the kernels
    run = subprocess.run([sys.executable, str(TOOL), "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    for launch in ("gate_up", "down"):
        broadcast = next(r for r in rows if r["launch"] == launch)
        # broadcast, the vector crosses shared memory in every loop step
        assert broadcast["barriers"] > 4 and broadcast["shared_stores"] > 1
        assert broadcast["barriers_in_loops"] > 4
        assert broadcast["weight_loads_128"] > 0  # the weights read as 16-byte vectors
