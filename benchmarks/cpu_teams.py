"""What the caller's idle OpenMP team costs the CPU worker (mira.runtime.threads.free_idle_team).

The worker computes one expert at a time (int8-shared, SiLU-gated, one token) from host blobs, in
two states of this thread's team, alternated round by round so that a machine drifting over the run
shifts both alike:

  kept      this thread ran a parallel operation with --caller-threads just before: its team is
            idle but held, as a loading thread's is
  let_go    the team let go (`free_idle_team`), as the runtime does where a worker computes

and timed two ways:

  expert_us  a pass of expert calls in the worker's thread while this thread waits
  job_us     a pass of one-expert jobs, each submitted from this thread and waited for (what the
             runtime sees: the hand-over both ways too)

Each figure: median and range over --repeats rounds, each the mean over one pass through --spread-gb
of distinct experts (no CPU cache holds a blob from the call before).

    python benchmarks/cpu_teams.py --threads 15 [--caller-threads 16] [--shapes qwen3-30b-a3b,mixtral-8x7b]
        [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import blobs_for, layout_for, shape_config, summary, worker_pass, write_result  # noqa: E402
from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.runtime.cpu_worker import CpuExpertWorker  # noqa: E402
from mira.runtime.threads import free_idle_team  # noqa: E402

STATES = ("kept", "let_go")
TIMINGS = ("expert", "job")
TEAM_WORK = 1 << 20  # elements of the elementwise operation that makes this thread's team again


def expert_pass(ffn: CpuExpertFFN, views: list[dict], x: torch.Tensor) -> float:
    """Mean microseconds per expert over one pass (runs in the worker's thread)."""
    start = time.perf_counter()
    for expert in views:
        ffn.expert(x, expert)
    return (time.perf_counter() - start) / len(views) * 1e6


def measure(name: str, args) -> dict:
    config = shape_config(name)
    layout = layout_for(config, "int8-shared")
    store, blobs = blobs_for(config, layout, args.spread_gb * 1e9, pin=torch.cuda.is_available())
    ffn = CpuExpertFFN(layout, F.silu)
    views = [layout.views(blob) for blob in blobs]
    x = torch.randn(1, layout.hidden).to(torch.bfloat16)
    team_work = torch.zeros(TEAM_WORK)
    times: dict[str, list[float]] = {f"{state}_{timing}": [] for state in STATES for timing in TIMINGS}
    with CpuExpertWorker(ffn, args.threads) as worker:
        worker.call(expert_pass, ffn, views[:2], x).result()  # first calls outside the timing
        for _ in range(args.repeats):
            for state in STATES:
                for timing in TIMINGS:
                    if state == "kept":
                        team_work.add_(1)  # this thread's team, made again and left idle
                    else:
                        free_idle_team()
                    times[f"{state}_{timing}"].append(worker.call(expert_pass, ffn, views, x).result()
                                                      if timing == "expert" else worker_pass(worker, blobs, x) * 1e6)
    del store
    row = {"hidden": layout.hidden, "intermediate": layout.intermediate, "blob_bytes": layout.nbytes,
           "distinct_blobs": len(blobs), "worker_threads": args.threads}
    for timing in TIMINGS:
        kept, let_go = (statistics.median(times[f"{state}_{timing}"]) for state in STATES)
        row[f"{timing}_us"] = {state: summary(times[f"{state}_{timing}"]) for state in STATES}
        row[f"{timing}_kept_over_let_go"] = kept / let_go
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads of the CPU worker")
    parser.add_argument("--caller-threads", type=int, default=None,
                        help="torch threads of this thread's team (default: torch's count now)")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b", help="comma-separated presets or HxI")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--spread-gb", type=float, default=1.0, help="distinct blob bytes cycled through")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-teams.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (median and range)")
    if args.caller_threads is not None:
        torch.set_num_threads(args.caller_threads)
    caller = torch.get_num_threads()
    results = {}
    print(f"{'shape':16s} {'timing':7s} {'kept us':>24s} {'let go us':>24s} {'kept/let go':>12s}")
    for name in filter(None, args.shapes.split(",")):
        row = results[name] = measure(name, args)
        for timing in TIMINGS:
            cells = [f"{t['median']:8.1f} [{t['min']:.1f}-{t['max']:.1f}]"
                     for t in (row[f"{timing}_us"][state] for state in STATES)]
            print(f"{name:16s} {timing:7s} {cells[0]:>24s} {cells[1]:>24s} {row[f'{timing}_kept_over_let_go']:12.2f}",
                  flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    write_result(args.out, {"caller_threads": caller, "worker_threads": args.threads, "repeats": args.repeats,
                            "spread_gb": args.spread_gb, "results": results}, device)


if __name__ == "__main__":
    main()
