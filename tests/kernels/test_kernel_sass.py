"""The decode GEMV launches' machine code, compiled for Hopper without a GPU (tools/kernel_sass.py):
reading the activation vector as whole tiles keeps shared memory and barriers out of the loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "kernel_sass.py"


def test_vector_tiles_keep_barriers_out_of_the_decode_loops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests' interpreter would replace the kernels
    run = subprocess.run([sys.executable, str(TOOL), "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    for launch in ("gate_up", "down"):
        broadcast = next(r for r in rows if r["launch"] == launch and not r["config"]["vector_tiles"])
        tiles = [r for r in rows if r["launch"] == launch and r["config"]["vector_tiles"]]
        # broadcast, the vector crosses shared memory in every loop step; as tiles, the one barrier left is
        # the final reduction's
        assert broadcast["barriers"] > 4 and broadcast["shared_stores"] > 1
        assert broadcast["barriers_in_loops"] > 4
        assert tiles and all(r["barriers"] == 1 and r["barriers_in_loops"] == 0 for r in tiles)
        same_unroll = next(r for r in tiles if r["config"]["unroll"] == broadcast["config"]["unroll"])
        assert same_unroll["weight_loads_128"] == broadcast["weight_loads_128"] > 0  # the same 16-byte weight loads
