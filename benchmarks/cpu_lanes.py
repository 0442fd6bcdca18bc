"""Several experts at once on fewer threads each, against one at a time on every thread (CPU).

A layer's CPU share of a small-expert model (Qwen3-30B-A3B, OLMoE-1B-7B) is a few experts of a few
MB each. The executor (mira.kernels.cpu_experts) computes them one after another on all of the
worker's threads, and each of its operations is too small to keep many threads busy. This times
the other way: the experts dealt round-robin to L lanes, each a Python thread of threads / L torch
threads computing its experts one after another, all lanes at once. Per shape and lane count,
microseconds per expert (int8-shared, one token, distinct synthetic blobs spread over --spread-gb
so no CPU cache holds one from the call before), median and range over --repeats passes; lanes 1
is the executor as it runs today.

    python benchmarks/cpu_lanes.py --threads 15 [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--lanes 1,2,3,5]
        [--experts 150] [--repeats 5] [--out benchmarks/results/cpu-lanes-h200.json]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import blobs_for, layout_for, shape_config, summary, write_result  # noqa: E402

from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402


def lanes_pass(layout: ExpertLayout, views: list[dict], x: torch.Tensor, lanes: int, threads: int) -> float:
    """Seconds per expert over `views`, dealt to `lanes` threads of threads // lanes torch threads each,
    from all lanes' start to the last one's end."""
    ffns = [CpuExpertFFN(layout, F.silu) for _ in range(lanes)]  # one cut buffer each
    start, done = threading.Barrier(lanes + 1), threading.Barrier(lanes + 1)
    errors: list[BaseException] = []

    def lane(index: int) -> None:
        try:
            torch.set_num_threads(max(1, threads // lanes))
            ffns[index].expert(x, views[index])  # this thread's first parallel region, outside the timing
        except BaseException as error:  # re-raised by the caller
            errors.append(error)
        start.wait()
        try:
            for i in (range(index, len(views), lanes) if not errors else ()):
                ffns[index].expert(x, views[i])
        except BaseException as error:
            errors.append(error)
        finally:
            done.wait()

    workers = [threading.Thread(target=lane, args=(index,)) for index in range(lanes)]
    for worker in workers:
        worker.start()
    start.wait()
    begin = time.perf_counter()
    done.wait()
    seconds = time.perf_counter() - begin
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return seconds / len(views)


def measure(name: str, args) -> dict:
    config = shape_config(name)
    layout = layout_for(config, "int8-shared")
    _store, blobs = blobs_for(config, layout, args.spread_gb * 1e9, pin=False)  # the store holds the blobs' memory
    views = [layout.views(blob) for blob in blobs[: args.experts]]
    x = torch.randn(1, layout.hidden).to(torch.bfloat16)
    result = {"hidden": layout.hidden, "intermediate": layout.intermediate, "blob_bytes": layout.nbytes,
              "experts": len(views), "lanes": {}}
    for lanes in args.lanes:
        if lanes > args.threads:
            continue
        lanes_pass(layout, views, x, lanes, args.threads)  # a pass outside the timing
        us = summary([lanes_pass(layout, views, x, lanes, args.threads) * 1e6 for _ in range(args.repeats)])
        result["lanes"][str(lanes)] = {"threads_per_lane": max(1, args.threads // lanes), "us_per_expert": us}
    one = result["lanes"]["1"]["us_per_expert"]["median"]
    for lanes, row in result["lanes"].items():
        row["speedup"] = one / row["us_per_expert"]["median"]
        print(f"{name:16s} {lanes:>2} lanes of {row['threads_per_lane']:>2} threads  "
              f"{row['us_per_expert']['median']:8.1f} us an expert  ({row['speedup']:.2f}x one lane)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads in all, shared by the lanes")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b", help="presets, comma-separated")
    parser.add_argument("--lanes", default="1,2,3,5", help="lane counts, comma-separated (1: today's executor)")
    parser.add_argument("--experts", type=int, default=150,
                        help="distinct experts a pass computes (more bytes than the CPU's caches hold)")
    parser.add_argument("--repeats", type=int, default=5, help="passes a figure (>= 3)")
    parser.add_argument("--spread-gb", type=float, default=1.0, help="bytes of distinct blobs to draw from")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-lanes.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (a median and a range)")
    args.lanes = sorted({1, *(int(n) for n in args.lanes.split(","))})
    shapes = {name: measure(name, args) for name in args.shapes.split(",")}
    write_result(args.out, {"threads": args.threads, "repeats": args.repeats, "spread_gb": args.spread_gb,
                            "shapes": shapes}, None)


if __name__ == "__main__":
    main()
