"""How fast a missed expert is served here: read in place by the decode kernel, or copied first.

The decode kernel reads a miss from the pinned store in place (zero-copy, DESIGN.md 2.8); the
alternative is a copy to a device slot, then the kernel reading the slot.

On some of the GPU machines' VMs the device's side of hybrid decoding ran well behind its
calibration, and GPU-only decoding (zero-copy misses) well behind its usual speed, while LRU
(inline: every miss copied) kept its speed. The calibration times copies; decoding reads
zero-copy. This fills --gb of the store's kind of host memory (mira.store.store.host_buffer,
page-locked as the store is) with copies of one quantized expert of --shape and times, over
MAX_CALLS blobs spread evenly over all of it (and over as many adjacent ones, for locality):

  copy            pinned-to-device copies into one slot (the copy engine)
  zero_copy       the decode kernel, one token, reading each blob in place
  hbm_kernel      the same kernel reading a device-resident blob (its compute alone)
  copy_then_read  a copy into a slot, then the kernel reading the slot, blob by blob
  both            zero-copy reads of half the blobs while the copy engine moves the other half

every figure in blob GB/s, one pass per figure per round, --repeats rounds: median and range.
With --launches, zero_copy again under 16 launch configurations of the decode kernel (programs,
warps, rows per program, bytes in flight per loop step): whether a slow zero-copy read is the
kernel's launch or the machine's.

    python benchmarks/miss_path.py --gb 40 [--shape mixtral-8x7b] [--repeats 3] [--launches] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import math
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import MAX_CALLS, layout_for, shape_config, summary, write_result  # noqa: E402
from host_pages import ZeroCopy, huge_kib, one_blob  # noqa: E402

from mira.kernels import make_moe_ffn  # noqa: E402
from mira.kernels.tuning import GemvConfig, KernelConfig  # noqa: E402
from mira.store.store import host_buffer  # noqa: E402


def machine_facts() -> dict:
    """What may tell two VMs apart: transparent huge pages, and the GPU's PCIe link as it reports it."""
    facts = {}
    try:
        facts["transparent_hugepage"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        facts["transparent_hugepage"] = None
    query = "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    try:
        facts["pcie_link"] = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["pcie_link"] = None
    return facts


class Passes:
    """One pass of each figure over a list of blobs; each returns blob bytes per second (CUDA events)."""

    def __init__(self, layout, device: torch.device, blob: torch.Tensor) -> None:
        self.nbytes = layout.nbytes
        self.zero_copy = ZeroCopy(layout, device)
        self.slot = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self.resident = blob.to(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.tables: dict[int, torch.Tensor] = {}  # blob address -> its address table [E = 1] on the device

    def prepare(self, blobs: list[torch.Tensor]) -> None:
        """Address tables for every blob a pass may read, made outside the timing."""
        for blob in [*blobs, self.slot, self.resident]:
            self.tables[blob.data_ptr()] = torch.tensor([blob.data_ptr()], dtype=torch.int64, device=self.slot.device)

    def timed(self, work, blobs: list[torch.Tensor]) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        work()
        end.record()
        torch.cuda.synchronize()
        return len(blobs) * self.nbytes / (begin.elapsed_time(end) / 1e3)

    def copy(self, blobs):
        return self.timed(lambda: [self.slot.copy_(blob, non_blocking=True) for blob in blobs], blobs)

    def zero_copy_read(self, blobs):
        return self.timed(lambda: self._read(blobs), blobs)

    def hbm_kernel(self, blobs):
        return self.timed(lambda: self._read([self.resident] * len(blobs)), blobs)

    def copy_then_read(self, blobs):
        def work():
            for blob in blobs:
                self.slot.copy_(blob, non_blocking=True)
                self._read([self.slot])
        return self.timed(work, blobs)

    def both(self, blobs):
        half = len(blobs) // 2

        def work():
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copy_stream):
                for blob in blobs[half:]:
                    self.slot.copy_(blob, non_blocking=True)
            self._read(blobs[:half])
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        return self.timed(work, blobs)

    def _read(self, blobs, ffn=None):
        z = self.zero_copy
        for blob in blobs:
            (ffn or z.ffn).forward_bases(z.x, z.index, z.weight, self.tables[blob.data_ptr()], out=z.out)

    def launches(self, layout, blobs, repeats: int) -> list[dict]:
        """zero_copy under each launch configuration of LAUNCHES: its fields and blob GB/s."""
        rows = []
        for rows_, unroll, warps, programs in LAUNCHES:
            config = KernelConfig(
                gate_up_gemv=GemvConfig(block_rows=rows_, block_cols=512, unroll=unroll, num_warps=warps,
                                        programs_per_sm=programs),
                down_gemv=GemvConfig(block_rows=16, block_cols=512, unroll=unroll, split=4 if programs else 1))
            ffn = make_moe_ffn(self.slot.device, layout, "silu", config=config)
            self._read(blobs[:2], ffn)  # untimed: compilation
            runs = [self.timed(lambda: self._read(blobs, ffn), blobs) / 1e9 for _ in range(repeats)]
            rows.append({"gate_up": {"block_rows": rows_, "unroll": unroll, "num_warps": warps,
                                     "programs_per_sm": programs},
                         "down_split": 4 if programs else 1, "GBps": summary(runs)})
        return rows


# the gate/up launch's rows per program, loads in flight per loop step, warps and programs per SM
# (the down launch takes the same unroll, and splits its reduction over 4 programs with the latter)
LAUNCHES = list(itertools.product((4, 16), (2, 8), (4, 8), (0, 8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=40.0, help="host memory filled with blobs (a store's size)")
    parser.add_argument("--shape", default="mixtral-8x7b", help="a preset of mira.bench.synthetic, or HxI")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launches", action="store_true",
                        help="also time zero-copy reads under 16 launch configurations of the decode kernel")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "miss-path.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("miss_path.py times PCIe reads and copies: it needs a CUDA GPU")
    device = torch.device("cuda")
    layout = layout_for(shape_config(args.shape), "int8-shared")
    blob = one_blob(layout)
    count = max(2 * MAX_CALLS, math.ceil(args.gb * 1e9 / layout.nbytes))
    before = huge_kib()
    memory = host_buffer((count, layout.nbytes))
    for row in memory:
        row.copy_(blob)
    huge_mib = (huge_kib() - before) / 1024
    error = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 0))
    if error:
        sys.exit(f"cudaHostRegister failed with cudaError {error}")
    stride = count // MAX_CALLS
    sets = {"spread": [memory[i * stride] for i in range(MAX_CALLS)], "adjacent": list(memory[:MAX_CALLS])}
    passes = Passes(layout, device, blob)
    for blobs in sets.values():
        passes.prepare(blobs)
    figures = {"copy": passes.copy, "zero_copy": passes.zero_copy_read, "hbm_kernel": passes.hbm_kernel,
               "copy_then_read": passes.copy_then_read, "both": passes.both}
    for figure in figures.values():  # untimed: compilation, first touches
        figure(sets["adjacent"][:2])
    runs = {(where, name): [] for where in sets for name in figures}
    for _ in range(args.repeats):  # every cell once per round: drift falls on all alike
        for where, blobs in sets.items():
            for name, figure in figures.items():
                runs[where, name].append(figure(blobs) / 1e9)
    launches = passes.launches(layout, sets["adjacent"], args.repeats) if args.launches else None
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
    cells = {where: {name: summary(runs[where, name]) for name in figures} for where in sets}
    print(f"{args.shape}: {count} blobs of {layout.nbytes / 1e6:.0f} MB, {huge_mib:.0f} MiB in huge pages")
    print(f"{'GB/s':16s}" + "".join(f"{where:>26s}" for where in sets))
    for name in figures:
        print(f"{name:16s}" + "".join(f"{cells[w][name]['median']:10.2f} [{cells[w][name]['min']:.2f}, "
                                      f"{cells[w][name]['max']:.2f}]".rjust(26) for w in sets))
    write_result(args.out, {"shape": args.shape, "blob_bytes": layout.nbytes, "blobs": count,
                            "huge_page_mib": huge_mib, "repeats": args.repeats, "facts": machine_facts(),
                            "GBps": cells, **({"zero_copy_launches": launches} if launches else {})}, "cuda")
    if launches:
        speeds = [row["GBps"]["median"] for row in launches]
        print(f"zero_copy under {len(launches)} launch configurations (adjacent): {min(speeds):.2f} to "
              f"{max(speeds):.2f} GB/s")


if __name__ == "__main__":
    main()
