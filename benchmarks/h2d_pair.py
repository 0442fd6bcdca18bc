"""Do the GPUs of one machine share their host-to-device bandwidth?

Runs that use two GPUs of one machine at once (one PCIe-bound bench per GPU, say) are only as
good as the answer: if the GPUs share a PCIe switch's uplink, or the host memory cannot feed both,
each run's copies are slower than they would be alone. This times pinned host -> device copies
(`--gb` GB in 256 MB pieces) on each GPU alone, then on all of them at once, one thread per GPU,
and prints the bandwidth of each GPU in both cases. Writes benchmarks/results/h2d-pair-<n>gpu.json
(or --out).

    python benchmarks/h2d_pair.py [--gb 4] [--out FILE]   (CUDA, two or more GPUs)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import result_header  # noqa: E402

PIECE = 256 << 20


class Copier:
    """One GPU's pinned source and device destination, and a timed copy of `pieces` pieces."""

    def __init__(self, index: int, pieces: int) -> None:
        self.device = torch.device("cuda", index)
        self.pieces = pieces
        self.host = torch.empty(PIECE, dtype=torch.uint8, pin_memory=True)
        self.dest = torch.empty(PIECE, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.seconds = 0.0

    def run(self) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.pieces):
                self.dest.copy_(self.host, non_blocking=True)
            end.record()
            end.synchronize()
            self.seconds = start.elapsed_time(end) / 1e3

    def gbps(self) -> float:
        return self.pieces * PIECE / self.seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="GB copied per GPU per measurement (default 4)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        sys.exit(f"h2d_pair.py compares GPUs copying alone and at once: it needs two or more GPUs, found {count}")
    copiers = [Copier(i, max(1, round(args.gb * 1e9 / PIECE))) for i in range(count)]
    for copier in copiers:  # warm-up
        copier.run()
    alone = []
    for copier in copiers:
        copier.run()
        alone.append(copier.gbps())
    threads = [threading.Thread(target=c.run) for c in copiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    together = [c.gbps() for c in copiers]
    result = {
        **result_header(" ".join(["python", "benchmarks/h2d_pair.py", *sys.argv[1:]]), copiers[0].device),
        "gpus": count,
        "gb_per_gpu": copiers[0].pieces * PIECE / 1e9,
        "alone_GBps": alone,
        "together_GBps": together,
        "together_over_alone": [t / a for t, a in zip(together, alone)],
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"h2d-pair-{count}gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'gpu':>4} {'alone GB/s':>11} {'together GB/s':>14} {'ratio':>6}")
    for i, (a, t) in enumerate(zip(alone, together)):
        print(f"{i:>4} {a:>11.1f} {t:>14.1f} {t / a:>6.2f}")


if __name__ == "__main__":
    main()
