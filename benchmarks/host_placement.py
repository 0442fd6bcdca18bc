"""Is a process whose CPU experts run slowly slow everywhere in its host memory, or in a part of it?

On the GPU machines' VMs the CPU's share of the misses ran at paces that differed by process, with
the same command, code and machine, while staying steady within a process. Each process fills its
expert store into a fresh host mapping, and a VM cannot see where its host places that memory (host
NUMA nodes, host page sizes): if some of it is slower to read, a process's pace depends on where
its store landed. This fills --gb of the store's kind of host memory (mira.store.store.host_buffer,
page-locked on CUDA as the store is) with copies of one quantized expert of --shape, notes the huge
pages the fill got (/proc/meminfo), then times, on every blob, the CPU executor's whole expert for
one token (this thread's team of --threads) and, on CUDA, the blob's pinned copy to a device slot:
a pass in address order, then one in reverse. Where a blob's time in one pass predicts its time in
the other (their correlation), the slowness lies in the memory; where it does not, elsewhere (the
threads, the host's other work). Run it in several processes to compare them.

    python benchmarks/host_placement.py --gb 24 --threads 15 [--shape mixtral-8x7b] [--out FILE]
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

from cpu_experts import layout_for, shape_config, write_result  # noqa: E402
from host_pages import huge_kib, one_blob, page_lock_s_per_gb  # noqa: E402

from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.store.store import host_buffer  # noqa: E402

SLOW = 1.15  # a blob is slow where both passes take this much more than their median


def cpu_seconds(ffn: CpuExpertFFN, views: list[dict], x: torch.Tensor, order: range) -> list[float]:
    """Seconds of the executor's whole expert on each blob, visited in `order`, listed by blob."""
    seconds = [0.0] * len(views)
    for i in order:
        start = time.perf_counter()
        ffn.expert(x, views[i])
        seconds[i] = time.perf_counter() - start
    return seconds


def copy_seconds(blobs: torch.Tensor, slot: torch.Tensor, order: range) -> list[float]:
    """Seconds of each blob's pinned copy to `slot` (CUDA events), visited in `order`, listed by blob."""
    events = {i: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for i in order}
    torch.cuda.synchronize()
    for i, (begin, end) in events.items():
        begin.record()
        slot.copy_(blobs[i], non_blocking=True)
        end.record()
    torch.cuda.synchronize()
    seconds = [0.0] * len(blobs)
    for i, (begin, end) in events.items():
        seconds[i] = begin.elapsed_time(end) / 1e3
    return seconds


def passes(forward: list[float], backward: list[float]) -> dict:
    """Both passes' per-blob times (ms), their spread, and how far a blob's time in one predicts the other."""
    both = [min(a, b) for a, b in zip(forward, backward)]
    ranked = sorted(both)
    medians = statistics.median(forward), statistics.median(backward)
    slow = [i for i, (a, b) in enumerate(zip(forward, backward)) if a > SLOW * medians[0] and b > SLOW * medians[1]]
    return {
        "median_ms": statistics.median(both) * 1e3,
        "p10_ms": ranked[len(ranked) // 10] * 1e3,
        "p90_ms": ranked[(9 * len(ranked)) // 10] * 1e3,
        "min_ms": ranked[0] * 1e3,
        "max_ms": ranked[-1] * 1e3,
        "forward_median_ms": medians[0] * 1e3,
        "backward_median_ms": medians[1] * 1e3,
        "correlation": statistics.correlation(forward, backward),
        "slow_in_both": len(slow) / len(both),
        "slow_blobs": slow,
        "forward_ms": [s * 1e3 for s in forward],
        "backward_ms": [s * 1e3 for s in backward],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=24.0, help="host memory to fill with blobs (default 24)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="this thread's torch threads (default: torch's)")
    parser.add_argument("--shape", default="mixtral-8x7b", help="a preset's expert shape, or HxI (default mixtral-8x7b)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host-placement.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    layout = layout_for(shape_config(args.shape), "int8-shared")
    count = int(args.gb * 1e9) // layout.nbytes
    if count < 10:
        raise SystemExit(f"host_placement: error: --gb {args.gb} holds {count} blobs of {layout.nbytes / 1e6:.0f} MB; "
                         "give at least 10 blobs' worth")
    blob = one_blob(layout)
    huge_before, start = huge_kib(), time.perf_counter()
    blobs = host_buffer((count, layout.nbytes))
    for row in blobs:
        row.copy_(blob)
    fill_s, huge_gb = time.perf_counter() - start, (huge_kib() - huge_before) * 1024 / 1e9
    lock_s_per_gb = page_lock_s_per_gb(blobs) if cuda else None
    ffn = CpuExpertFFN(layout, F.silu)
    views = [ffn.views(row) for row in blobs]
    x = torch.randn(1, layout.hidden).to(torch.bfloat16)
    cpu_seconds(ffn, views[:4], x, range(4))  # the team started, the kernels' first-call work done
    forward, backward = range(count), range(count - 1, -1, -1)
    figures = {"shape": args.shape, "blob_bytes": layout.nbytes, "blobs": count, "threads": args.threads,
               "fill_s": fill_s, "huge_pages_gb": huge_gb, "page_lock_s_per_gb": lock_s_per_gb,
               "cpu": passes(cpu_seconds(ffn, views, x, forward), cpu_seconds(ffn, views, x, backward))}
    if cuda:
        slot = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
        copy_seconds(blobs, slot, range(4))
        figures["copy"] = passes(copy_seconds(blobs, slot, forward), copy_seconds(blobs, slot, backward))
    print(f"{args.shape}: {count} blobs of {layout.nbytes / 1e6:.0f} MB ({huge_gb:.1f} GB of them in huge pages), "
          f"{args.threads} threads")
    print(f"{'':6}{'median ms':>10}{'p10':>8}{'p90':>8}{'max':>8}{'corr fwd/bwd':>14}{'slow in both':>14}")
    for name in ("cpu", "copy"):
        if name in figures:
            f = figures[name]
            print(f"{name:6}{f['median_ms']:10.3f}{f['p10_ms']:8.3f}{f['p90_ms']:8.3f}{f['max_ms']:8.3f}"
                  f"{f['correlation']:14.2f}{f['slow_in_both']:14.1%}")
    write_result(args.out, figures, "cuda" if cuda else None)


if __name__ == "__main__":
    main()
