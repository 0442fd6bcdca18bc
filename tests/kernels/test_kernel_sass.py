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


def test_int4_gate_up_loop_is_its_half2_arithmetic_and_little_else():
    """The stored INT4 gate/up launch (64 x 1024, unroll 16, 8 warps, half2) at Mixtral's shape: a
    loop step of each of its two matrices gives each of 256 threads 16 sub-steps of 2 words (8 codes
    each), so 256 codes, whose products take one HFMA2 a pair of codes (128) and whose high nibbles
    one more a pair (64): 192 a matrix, 384 in all. Everything else in the loops (loads, addresses,
    low-nibble conversions, the group's scales) stays under 4.5 instructions a code in all, and no
    load carries an eviction hint (each built its cache policy in the loop; measured no faster)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TOOL), "--scheme", "int4", "--json"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    gate_up = next(r for r in json.loads(run.stdout) if r["launch"] == "gate_up")
    config = gate_up["config"]
    assert (config["block_rows"], config["block_cols"], config["unroll"], config["num_warps"], config["cvt"]) == \
        (64, 1024, 16, 8, "half2")  # the shape the counts below are worked out for
    codes = 2 * 256
    assert gate_up["half2_fmas_in_loops"] >= codes * 3 // 4
    assert gate_up["instructions_in_loops"] < 4.5 * codes
    # one innermost loop a matrix (gate, then up), each a step with at least its 192 HFMA2s, inside the rest
    steps = gate_up["instructions_in_innermost_loops"]
    assert len(steps) == 2 and min(steps) >= codes // 2 * 3 // 4 and sum(steps) <= gate_up["instructions_in_loops"]
    assert gate_up["evict_first_loads"] == 0


def test_int4_launches_of_ones_choosing_give_each_thread_its_share():
    """--launch: INT4 gate/up at H = 2048 (the small experts' rows) in one step of 2048 columns, on 8
    warps (the untuned default) and on 16. A matrix's step gives each thread 64 rows x 2048 columns /
    8 codes a word / (32 x warps) threads: 64 words (512 codes) on 8 warps, 32 on 16; at least 3/4
    of an HFMA2 a code (one a pair for the products, one a pair for the high nibbles) in each of the
    two matrices. Twice the warps, half the arithmetic in a thread's loop step."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TOOL), "--scheme", "int4", "--hidden", "2048", "--intermediate", "768",
                          "--launch", "gate_up:2048:8", "--launch", "gate_up:2048:16", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [(r["launch"], r["config"]["block_cols"], r["config"]["num_warps"]) for r in rows] == \
        [("gate_up", 2048, 8), ("gate_up", 2048, 16)]
    for row, codes in zip(rows, (512, 256)):
        assert row["half2_fmas_in_loops"] >= 2 * codes * 3 // 4
        assert len(row["instructions_in_innermost_loops"]) == 2  # gate, then up: one step of 2048 columns each
    eight, sixteen = (row["half2_fmas_in_loops"] for row in rows)
    assert sixteen < 0.55 * eight


def test_launch_option_refuses_what_the_int4_kernels_do_not_split():
    run = subprocess.run([sys.executable, str(TOOL), "--scheme", "int4", "--launch", "gate_up:512:8:4"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "drop the split" in run.stderr
