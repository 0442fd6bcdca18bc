"""Does the page size of the host store matter? The same expert blobs in two kinds of host memory:

  shared        an anonymous shared mapping, which Linux backs with 4 KiB pages unless shmem huge
                pages are enabled
  private-huge  an anonymous private mapping advised MADV_HUGEPAGE, which Linux backs with 2 MiB
                pages where transparent huge pages are enabled ("always" or "madvise"); what the
                expert store uses (mira.store.store.host_buffer)

and, for each kind, what reads the blobs in decoding: the CPU expert executor (one token, --threads
threads) and, on CUDA, the device: a blob copied to a slot (pinned copy) and the decode kernel
reading it in place (zero-copy). Large pages mean fewer TLB misses for the CPU's streaming reads
and fewer mappings for the device's reads of host memory. Every figure is a pass through distinct
blobs (at most cpu_experts.MAX_CALLS of the --spread-gb per kind, so no cache holds one from the
pass before), one pass per kind per round, --repeats rounds: median and range. The huge pages each
kind actually got are reported (AnonHugePages and ShmemHugePages of /proc/meminfo, before and after
filling it).

    python benchmarks/host_pages.py --threads 15 [--shapes mixtral-8x7b,qwen3-30b-a3b] [--spread-gb 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import mmap
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import (  # noqa: E402
    MAX_CALLS, copy_pass, layout_for, shape_config, summary, time_pass, write_result,
)

from mira.kernels import make_moe_ffn  # noqa: E402
from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.store.quant import quantize_expert  # noqa: E402

KINDS = ("shared", "private-huge")
MEMINFO_HUGE = ("AnonHugePages", "ShmemHugePages")


def host_blobs(kind: str, count: int, blob: torch.Tensor) -> torch.Tensor:
    """[count, B] copies of `blob` in host memory of `kind` (see the module docstring)."""
    nbytes = count * blob.numel()
    if kind == "shared":
        mapping = mmap.mmap(-1, nbytes)
    else:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    blobs = torch.frombuffer(mapping, dtype=torch.uint8).view(count, blob.numel())
    for row in blobs:
        row.copy_(blob)
    return blobs


def huge_kib() -> int:
    """KiB of huge pages backing anonymous and shmem memory now (0 where /proc/meminfo is absent)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in lines if line.split(":")[0] in MEMINFO_HUGE)


def one_blob(layout) -> torch.Tensor:
    """A quantized expert of random weights (sane scales: no denormals or NaNs to slow the CPU)."""
    g = torch.Generator().manual_seed(0)
    H, I = layout.hidden, layout.intermediate
    w13 = torch.randn(2 * I, H, generator=g) / math.sqrt(H)
    w2 = torch.randn(H, I, generator=g) / math.sqrt(I)
    blob = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(quantize_expert(w13, w2, layout), blob)
    return blob


class ZeroCopy:
    """The decode kernel reading host blobs in place: one token routed to each in turn."""

    def __init__(self, layout, device: torch.device) -> None:
        self.device = device
        self.ffn = make_moe_ffn(device, layout, F.silu)
        self.x = torch.randn(1, layout.hidden, device=device).to(torch.bfloat16)
        self.index = torch.zeros(1, 1, dtype=torch.int64, device=device)
        self.weight = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        self.out = torch.empty(1, layout.hidden, dtype=torch.bfloat16, device=device)

    def GBps(self, blobs: torch.Tensor) -> float:
        """Blob bytes per second over one pass (at most MAX_CALLS blobs, as `copy_pass`; CUDA events)."""
        calls = blobs[:MAX_CALLS]
        tables = [torch.tensor([blob.data_ptr()], dtype=torch.int64, device=self.device) for blob in calls]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for table in tables:
            self.ffn.forward_bases(self.x, self.index, self.weight, table, out=self.out)
        end.record()
        end.synchronize()
        return calls.numel() / (begin.elapsed_time(end) / 1e3) / 1e9


def page_lock_s_per_gb(blobs: torch.Tensor) -> float:
    """Seconds per GB to page-lock the blobs in place (cudaHostRegister, as the store is)."""
    start = time.perf_counter()
    error = int(torch.cuda.cudart().cudaHostRegister(blobs.data_ptr(), blobs.numel(), 0))
    seconds = time.perf_counter() - start
    if error:
        raise RuntimeError(f"cudaHostRegister failed with cudaError {error}")
    return seconds / (blobs.numel() / 1e9)


def measure_shape(shape: str, spread_gb: float, repeats: int, cuda: bool) -> dict:
    """Every figure of one expert shape, for both kinds of memory (see the module docstring)."""
    layout = layout_for(shape_config(shape), "int8-shared")
    blob = one_blob(layout)
    count = max(2, math.ceil(spread_gb * 1e9 / layout.nbytes))
    memory, huge_mib, lock = {}, {}, {}
    for kind in KINDS:
        before = huge_kib()
        memory[kind] = host_blobs(kind, count, blob)
        huge_mib[kind] = (huge_kib() - before) / 1024
        if cuda:
            lock[kind] = page_lock_s_per_gb(memory[kind])
        print(f"{shape} {kind:13s} {count} blobs, {huge_mib[kind]:.0f} MiB of them in huge pages", flush=True)
    ffn = CpuExpertFFN(layout, F.silu)
    x = torch.randn(1, layout.hidden).to(torch.bfloat16)
    measures = {"cpu_expert_us": lambda blobs: time_pass(ffn, list(blobs), x) * 1e6}
    if cuda:
        slot = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
        measures |= {"copy_GBps": lambda blobs: layout.nbytes / copy_pass(list(blobs), slot) / 1e9,
                     "zero_copy_GBps": ZeroCopy(layout, torch.device("cuda")).GBps}
    for measure in measures.values():  # first passes untimed (compilation, first touches)
        measure(memory[KINDS[0]][:2])
    runs = {(kind, name): [] for kind in KINDS for name in measures}
    for _ in range(repeats):  # every cell once per round: drift over the run falls on all alike
        for kind in KINDS:
            for name, measure in measures.items():
                runs[kind, name].append(measure(memory[kind]))
    if cuda:
        torch.cuda.synchronize()
        for kind in KINDS:
            torch.cuda.cudart().cudaHostUnregister(memory[kind].data_ptr())
    kinds = {kind: {"huge_page_mib": huge_mib[kind], **({"page_lock_s_per_gb": lock[kind]} if cuda else {}),
                    **{name: summary(runs[kind, name]) for name in measures}} for kind in KINDS}
    for name in measures:
        cells = "  ".join(f"{kind} {kinds[kind][name]['median']:9.3f} ({kinds[kind][name]['min']:.3f}-"
                          f"{kinds[kind][name]['max']:.3f})" for kind in KINDS)
        print(f"{shape} {name:15s} {cells}", flush=True)
    return {"hidden": layout.hidden, "intermediate": layout.intermediate, "blob_bytes": layout.nbytes,
            "blobs_per_kind": count, "kinds": kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads of the CPU executor")
    parser.add_argument("--shapes", default="mixtral-8x7b",
                        help="comma-separated presets of mira.bench.synthetic or HxI")
    parser.add_argument("--spread-gb", type=float, default=2.0, help="distinct blob bytes per kind and shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host-pages.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    shapes = {shape: measure_shape(shape, args.spread_gb, args.repeats, cuda) for shape in args.shapes.split(",")}
    write_result(args.out, {"threads": torch.get_num_threads(), "repeats": args.repeats, "shapes": shapes},
                 "cuda" if cuda else None)


if __name__ == "__main__":
    main()
