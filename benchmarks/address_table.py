"""Host time of preparing the fused kernels' address table for one MoE layer call (issue #5).

Two ways, timed per call (best of 5 runs of N calls), kernels not launched:

    blob list   `TritonMoEFFN.__call__`'s preparation: check every blob, stage the addresses in a new
                (pinned, on CUDA) tensor, copy it to the device table
    table       `AddressTable.fill`, what MiraExperts does: write the routed experts' addresses into
                a preallocated host array, one non-blocking copy into a preallocated device table

for the expert counts of three model shapes, with the store's blobs of the routed experts given
and None elsewhere (as `ExpertCache.fetch` gives them). On the CPU the blob list's staging is
not pinned, so it is faster there than on a GPU machine.

    python benchmarks/address_table.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mira.kernels.addresses import AddressTable
from mira.kernels.triton_ffn import TritonMoEFFN
from mira.kernels.tuning import KernelConfig
from mira.store.layout import ExpertLayout
from mira.bench.provenance import result_header

SHAPES = {"mixtral-8x7b": (8, 2), "deepseek-v2-lite": (64, 6), "qwen3-30b-a3b": (128, 8)}  # E experts, K routed


def best_us(fn, calls: int, device: torch.device) -> float:
    """Microseconds per call of fn, best of 5 runs (the device drained between runs, not inside)."""
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def measure(name: str, device: torch.device, calls: int) -> dict:
    experts, routed = SHAPES[name]
    layout = ExpertLayout("int8-shared", 128, 128)  # the blob size does not matter here
    rows = torch.empty(experts, layout.nbytes, dtype=torch.uint8, device=device)  # like the slot buffer
    chosen = sorted(torch.randperm(experts, generator=torch.Generator().manual_seed(0))[:routed].tolist())
    blobs = [rows[e] if e in chosen else None for e in range(experts)]
    ffn = TritonMoEFFN(layout, device, config=KernelConfig(), num_experts=experts)
    table = AddressTable(experts, device)
    figures = {
        "experts": experts,
        "routed": routed,
        "blob_list_us": best_us(lambda: ffn._address_table(blobs), calls, device),  # what __call__ does first
        "table_us": best_us(lambda: table.fill(blobs, chosen), calls, device),
    }
    assert torch.equal(ffn._address_table(blobs).cpu(), table.fill(blobs, chosen).cpu())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    machine = "h200" if device.type == "cuda" else "cpu"
    results = {name: measure(name, device, args.calls) for name in SHAPES}
    print(f"{'shape':18s} {'E':>4s} {'routed':>6s} {'blob list us':>13s} {'table us':>9s}")
    for name, f in results.items():
        print(f"{name:18s} {f['experts']:4d} {f['routed']:6d} {f['blob_list_us']:13.1f} {f['table_us']:9.1f}")
    result = {
        **result_header(" ".join([Path(sys.executable).name, *sys.argv]), device),
        "setup": {"calls": args.calls, "device": str(device), "torch": torch.__version__},
        "figures": results,
    }
    out = Path(__file__).parent / "results" / f"address-table-{machine}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
