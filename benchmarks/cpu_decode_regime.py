"""Which setting of decoding makes the CPU worker compute an expert more slowly than calibrated.

In decoding the worker's compute time per expert has run well above the calibrated one
(mira.runtime.calibrate times `CpuExpertFFN.expert` back to back on the worker's thread). This
sends one-token, one-expert jobs through the runtime's own path (HostRows.stage, then
CpuExpertWorker.submit: the job waits for its rows, computes, writes its partial sum), one at a
time over distinct blobs, and varies what decoding has and calibration does not:

  gap    idle seconds between jobs (0: back to back; decoding leaves the worker idle between layers)
  host   this thread while a job runs: idle (waits on it), launching (keep_host_busy, as calibration
         does), cuda-waiting (CUDA only: short GPU sleeps launched and waited for in a loop, as
         decoding's per-layer routing read-backs make the host wait), decoding (CUDA only: a
         layer's worth of small GPU operations launched between stretches of Python, then a
         wait for them, in a loop)
  pcie   (CUDA only) pinned-to-device copies streaming meanwhile, as misses read over PCIe
  switch the interpreter's switch interval (--switch-ms): how long the worker, wanting the GIL
         back after an operation, waits before it asks the host thread to let it go

Every cell runs once per round, --repeats rounds, so that a machine drifting over the run shifts
all cells alike. Figures: the worker's own time per job (`CpuJob.compute_s`: rows ready to partial
sum written), in us: the mean of each round's pass of --calls jobs (median and range over the
rounds, as decoding's telemetry reports means), and the median and 90th percentile of all the
cell's jobs (a long tail shows as a mean above the median); beside them, per thread count, the
calibration's way (`expert` back to back on the worker's thread, this thread idle; a mean) over
the same blobs.

    python benchmarks/cpu_decode_regime.py --threads 8,15 [--shape mixtral-8x7b] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import blobs_for, layout_for, shape_config, summary, time_pass, write_result  # noqa: E402

from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.runtime.calibrate import keep_host_busy  # noqa: E402
from mira.runtime.cpu_worker import CpuExpertWorker, HostRows  # noqa: E402

GPU_SLEEP_CYCLES = 100_000  # one launch of cuda-waiting: about 50 us at H200 clocks
LAYER_LAUNCHES, LAYER_PYTHON = 40, 100  # decoding: GPU operations per layer, and Python between two
COPY_SECONDS_PER_JOB = 0.01  # copies enqueued per job of a pass with pcie on (outlasting it)
PCIE_BYTES_PER_S = 55e9  # sizes that load (the H200 machine's pinned-to-device bandwidth)


def cuda_waiting(future: Future) -> None:
    """Until `future` is done: launch a short GPU sleep and wait for it (the GIL goes meanwhile)."""
    while not future.done():
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        torch.cuda.synchronize()


def decoding(future: Future) -> None:
    """Until `future` is done: small GPU operations launched between stretches of Python (which
    hold the GIL), then a wait for them, as a layer of eager decoding and its routing read-back."""
    a = torch.zeros(64, device="cuda")
    while not future.done():
        for _ in range(LAYER_LAUNCHES):
            a.add_(1.0)
            sum(range(LAYER_PYTHON))
        torch.cuda.synchronize()


HOSTS = {"idle": lambda future: None, "launching": keep_host_busy, "cuda-waiting": cuda_waiting,
         "decoding": decoding}
CUDA_HOSTS = ("cuda-waiting", "decoding")


def job_pass(worker: CpuExpertWorker, rows: HostRows, blobs: list[torch.Tensor], calls: int, gap_s: float,
             host, device: torch.device) -> list[float]:
    """Seconds of the worker's own compute of each of `calls` one-expert jobs, one at a time."""
    hidden = torch.randn(1, rows.hidden.shape[1], device=device).to(rows.hidden.dtype)
    index = torch.zeros(1, 1, dtype=torch.int64, device=device)
    weights = torch.ones(1, 1, device=device)
    times = []
    for i in range(calls):
        job = rows.stage(hidden, index, weights, 0, [0], [blobs[i % len(blobs)]])
        future = worker.submit(job)
        host(future)
        future.result()
        times.append(job.compute_s)
        if gap_s:
            time.sleep(gap_s)
    return times


def copy_load(blobs: list[torch.Tensor], copies: int, device: torch.device) -> torch.cuda.Stream:
    """`copies` pinned-to-device blob copies enqueued on a stream of their own."""
    stream = torch.cuda.Stream(device=device)
    slot = torch.empty(blobs[0].numel(), dtype=torch.uint8, device=device)
    with torch.cuda.stream(stream):
        for i in range(copies):
            slot.copy_(blobs[(i + 1) % len(blobs)], non_blocking=True)
    return stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", required=True, help="comma-separated torch thread counts of the worker")
    parser.add_argument("--shape", default="mixtral-8x7b", help="a preset of mira.bench.synthetic or HxI")
    parser.add_argument("--gaps-ms", default="0,1,4", help="comma-separated idle milliseconds between jobs")
    parser.add_argument("--switch-ms", default="5,0.1", help="comma-separated switch intervals of the interpreter")
    parser.add_argument("--spread-gb", type=float, default=1.0, help="distinct blob bytes cycled through")
    parser.add_argument("--calls", type=int, default=16, help="jobs per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-decode-regime.json")
    args = parser.parse_args()
    if args.repeats < 1 or args.calls < 1:
        parser.error("--repeats and --calls must be at least 1")
    threads = [int(t) for t in args.threads.split(",")]
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    switches = [float(w) / 1e3 for w in args.switch_ms.split(",")]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = shape_config(args.shape)
    layout = layout_for(config, "int8-shared")
    store, blobs = blobs_for(config, layout, args.spread_gb * 1e9, pin=cuda)
    ffn = CpuExpertFFN(layout, F.silu)
    hosts = [h for h in HOSTS if cuda or h not in CUDA_HOSTS]
    loads = (False, True) if cuda else (False,)
    rows = HostRows(1, layout.hidden, 1, torch.bfloat16, device)
    x = torch.randn(1, layout.hidden).to(torch.bfloat16)
    results = []
    default_switch = sys.getswitchinterval()
    cells = list(itertools.product(switches, gaps, hosts, loads))
    copies = round(args.calls * COPY_SECONDS_PER_JOB * PCIE_BYTES_PER_S / layout.nbytes)
    for count in threads:
        with CpuExpertWorker(ffn, count) as worker:
            job_pass(worker, rows, blobs, 2, 0.0, HOSTS["idle"], device)  # first jobs untimed
            calibration, passes = [], {cell: [] for cell in cells}
            for _ in range(args.repeats):  # every cell once per round, so that drift falls on all alike
                calibration.append(worker.call(time_pass, ffn, blobs, x).result() * 1e6)
                for cell in cells:
                    switch, gap, host, pcie = cell
                    sys.setswitchinterval(switch)
                    load = copy_load(blobs, copies, device) if pcie else None
                    passes[cell].append([t * 1e6 for t in job_pass(worker, rows, blobs, args.calls, gap, HOSTS[host],
                                                                    device)])
                    if load is not None:
                        load.synchronize()
                sys.setswitchinterval(default_switch)
            calibrated = summary(calibration)
            print(f"{worker.threads:2d} threads  calibration's way {calibrated['median']:8.1f} us", flush=True)
            for (switch, gap, host, pcie), times in passes.items():
                row = summary([statistics.fmean(t) for t in times])
                every = [t for pass_times in times for t in pass_times]
                p90 = statistics.quantiles(every, n=10)[-1] if len(every) > 1 else every[0]
                results.append({"threads": worker.threads, "switch_ms": switch * 1e3, "gap_ms": gap * 1e3,
                                "host": host, "pcie": pcie, "compute_us": row, "median_us": statistics.median(every),
                                "p90_us": p90, "over_calibration": row["median"] / calibrated["median"],
                                "calibration_us": calibrated})
                print(f"{worker.threads:2d} threads  switch {switch * 1e3:3.1f} ms  gap {gap * 1e3:3.0f} ms  "
                      f"host {host:12s}  pcie {'on ' if pcie else 'off'}  mean {row['median']:8.1f} us "
                      f"({row['min']:.1f}-{row['max']:.1f})  median {statistics.median(every):8.1f}  p90 {p90:8.1f}  "
                      f"{row['median'] / calibrated['median']:.2f}x calibration", flush=True)
    sys.setswitchinterval(default_switch)
    write_result(args.out, {"shape": args.shape, "hidden": layout.hidden, "intermediate": layout.intermediate,
                            "blob_bytes": layout.nbytes, "distinct_blobs": len(blobs), "repeats": args.repeats,
                            "calls": args.calls, "cells": results}, "cuda" if cuda else None)
    del store


if __name__ == "__main__":
    main()
