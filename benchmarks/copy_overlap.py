"""Expert copies overlapped with expert compute, and zero-copy misses, at real shapes (issue #5).

Per expert shape (Mixtral-8x7B, DeepSeek-V2-Lite, Qwen3-30B-A3B: random int8-shared blobs, bf16
activations, one token routed top-k over a layer's experts, as in decode), on one GPU:

- copy alone: `--gb` GB of expert blobs from pinned host memory into device rows through Mira's
  transfer layer (`mira.cache.transfer.Transfer`, the prefetch stream, an event per row);
- compute alone: the fused decode kernels over resident experts, replayed from a CUDA graph;
- mixed: the same copies and, at once on a stream of their own, as many replays as cover them. The
  copy bandwidth while compute runs is the figure the issue asks for (>= 90% of the copy alone),
  with the compute's slowdown beside it;
- zero-copy misses: one decode launch whose k routed experts are all read from pinned host memory
  (what a layer whose routed experts all missed costs), in GB/s against the copy alone; with the
  tuned launch configuration, and with variants of it (`ZERO_COPY_VARIANTS`: reads over PCIe may
  want more bytes in flight, more programs, or fewer programs walking longer runs of rows than
  reads from HBM).

CUDA events time each stream; "span" is first event to last. Prints a table and writes
benchmarks/results/copy-overlap-h200.json (or --out).

    python benchmarks/copy_overlap.py [--gb 1.5] [--shapes mixtral-8x7b,...] [--out FILE]   (CUDA only)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels_int8 import Timer, random_slots, relative_error  # noqa: E402
from mira.kernels.reference import moe_ffn_reference  # noqa: E402
from mira.kernels.triton_ffn import TritonMoEFFN  # noqa: E402
from mira.cache.transfer import Transfer  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.bench.provenance import result_header

SHAPES = {  # hidden, intermediate, experts per layer, routed per token
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}
ZERO_COPY_VARIANTS = {  # name -> the variant of a decode launch's tuned GemvConfig (both launches)
    "unroll 4": lambda gemv: dataclasses.replace(gemv, unroll=4),
    "half the rows per program": lambda gemv: dataclasses.replace(gemv, block_rows=max(2, gemv.block_rows // 2)),
    # gate/up: 4 programs per SM, each walking a contiguous run of a pair's rows (down ignores it)
    "runs of rows": lambda gemv: dataclasses.replace(gemv, programs_per_sm=4),
}
RESIDENT_BYTES = 512 << 20  # resident blobs the compute rotates over: well past the 60 MB L2
GRAPH_CALLS = 32


class ShapeRun:
    def __init__(self, name: str, gigabytes: float, device: torch.device, timer: Timer):
        hidden, intermediate, experts, top_k = SHAPES[name]
        self.name, self.device, self.timer, self.top_k = name, device, timer, top_k
        self.layout = ExpertLayout("int8-shared", hidden, intermediate)
        nbytes = self.layout.nbytes
        gen = torch.Generator(device=device).manual_seed(0)
        resident = max(experts, math.ceil(RESIDENT_BYTES / nbytes))
        self.slots = random_slots(self.layout, resident, device, gen)  # [R, B] on the device
        self.copies = max(2, math.ceil(gigabytes * 1e9 / nbytes))
        self.host = torch.empty(self.copies, nbytes, dtype=torch.uint8, pin_memory=True)  # [C, B]
        for row in range(self.copies):
            self.host[row].copy_(self.slots[row % resident])
        self.rows = torch.empty(self.copies, nbytes, dtype=torch.uint8, device=device)  # copy destinations
        self.transfer = Transfer(device, self.copies)
        self.ffn = TritonMoEFFN(self.layout, device, num_experts=experts)
        self.x = [torch.randn(1, hidden, generator=gen, device=device).to(torch.bfloat16) for _ in range(GRAPH_CALLS)]
        self.out = torch.empty(1, hidden, dtype=torch.bfloat16, device=device)
        self.routes, self.tables = [], []
        for call in range(GRAPH_CALLS):
            index = torch.randperm(experts, generator=gen, device=device)[:top_k].view(1, top_k)
            weight = torch.softmax(torch.randn(1, top_k, generator=gen, device=device), -1).to(torch.bfloat16)
            self.routes.append((index, weight))
            first = (call * experts) % resident
            self.tables.append(torch.tensor([self.slots[(first + e) % resident].data_ptr() for e in range(experts)],
                                            dtype=torch.int64, device=device))
        # zero-copy: call c's routed experts read from their own pinned host rows (bytes equal to their slots)
        self.zero_copy_calls = min(GRAPH_CALLS, self.copies // top_k)
        self.host_tables = []
        for call in range(self.zero_copy_calls):
            table = self.tables[call].clone()
            first = (call * experts) % resident
            for k, expert in enumerate(self.routes[call][0][0].tolist()):
                row = call * top_k + k
                self.host[row].copy_(self.slots[(first + expert) % resident])
                table[expert] = self.host[row].data_ptr()
            self.host_tables.append(table)

    def decode(self, call: int, table: torch.Tensor | None = None) -> torch.Tensor:
        index, weight = self.routes[call]
        return self.ffn.forward_bases(self.x[call], index, weight, self.tables[call] if table is None else table,
                                      out=self.out)

    def zero_copy_variants(self, copy_alone_GBps: float) -> dict:
        """The zero-copy call timed with each of ZERO_COPY_VARIANTS (outputs checked against the
        tuned launches' first)."""
        tuned, results = self.ffn, {}
        expected = self.decode(0, self.host_tables[0]).clone()
        for name, vary in ZERO_COPY_VARIANTS.items():
            config = dataclasses.replace(tuned.config, gate_up_gemv=vary(tuned.config.gate_up_gemv),
                                         down_gemv=vary(tuned.config.down_gemv))
            self.ffn = TritonMoEFFN(self.layout, self.device, config=config, num_experts=self.tables[0].numel())
            try:
                same = relative_error(self.decode(0, self.host_tables[0]), expected)
                seconds = self.timer.graph(lambda call: self.decode(call, self.host_tables[call]), self.zero_copy_calls)
                gbps = self.top_k * self.layout.nbytes / seconds / 1e9
                results[name] = {"gate_up": dataclasses.asdict(config.gate_up_gemv),
                                 "down": dataclasses.asdict(config.down_gemv), "relative_difference": same,
                                 "zero_copy_call_s": seconds, "zero_copy_GBps": gbps,
                                 "zero_copy_over_copy_alone": gbps / copy_alone_GBps}
            except Exception as error:  # a variant the compiler refuses
                results[name] = {"error": repr(error)[:200]}
        self.ffn = tuned
        return results

    def check(self) -> dict:
        """Call 0 from slots and from pinned host memory, against the fp32 reference."""
        index, weight = self.routes[0]
        blobs = [None] * self.tables[0].numel()
        for expert in index[0].tolist():
            blobs[expert] = self.slots[expert]  # call 0's table starts at slot 0
        reference = moe_ffn_reference(self.x[0].float(), index, weight.float(), blobs, self.layout,
                                      torch.nn.functional.silu)
        from_slots = self.decode(0).clone()
        from_host = self.decode(0, self.host_tables[0]).clone()
        return {"relative_error_vs_fp32_reference": relative_error(from_slots, reference),
                "zero_copy_equals_slots": bool(torch.equal(from_slots, from_host))}

    def enqueue_copies(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        stream = self.transfer.prefetch_stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        start.record(stream)
        for row in range(self.copies):
            self.transfer.load(self.host[row], self.rows[row], row)
        end.record(stream)
        return start, end

    def measure(self) -> dict:
        nbytes, total = self.layout.nbytes, self.copies * self.layout.nbytes
        per_call = self.timer.graph(lambda call: self.decode(call), GRAPH_CALLS)
        zero_copy = self.timer.graph(lambda call: self.decode(call, self.host_tables[call]), self.zero_copy_calls)

        copy_times = []
        for _ in range(3):
            start, end = self.enqueue_copies()
            end.synchronize()
            copy_times.append(start.elapsed_time(end) / 1e3)
        copy_alone = min(copy_times)

        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in range(GRAPH_CALLS):
                self.decode(call)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for call in range(GRAPH_CALLS):
                self.decode(call)
        replays = max(1, math.ceil(1.2 * copy_alone / (per_call * GRAPH_CALLS)))
        graph.replay()  # warm: the first replay uploads the graph
        torch.cuda.synchronize()
        compute_start, compute_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the compute goes first, on its own stream: the copies wait only for the current stream's work
        # (Transfer.load), and enqueueing hundreds of copies takes the host milliseconds
        with torch.cuda.stream(stream):
            compute_start.record(stream)
            for _ in range(replays):
                graph.replay()
            compute_end.record(stream)
        copy_start, copy_end = self.enqueue_copies()
        torch.cuda.synchronize()
        copy_mixed = copy_start.elapsed_time(copy_end) / 1e3
        compute_mixed = compute_start.elapsed_time(compute_end) / 1e3 / (replays * GRAPH_CALLS)
        # overlap: the share of the copy span during which the compute ran
        lead = copy_start.elapsed_time(compute_start) / 1e3  # compute start after copy start (s; < 0: before)
        compute_span = compute_start.elapsed_time(compute_end) / 1e3
        overlap = max(0.0, min(copy_mixed, lead + compute_span) - max(0.0, lead)) / copy_mixed
        del graph
        return {
            "blob_bytes": nbytes,
            "top_k": self.top_k,
            "copies": self.copies,
            "copied_bytes": total,
            "copy_alone_s": copy_alone,
            "copy_alone_GBps": total / copy_alone / 1e9,
            "decode_call_alone_s": per_call,
            "copy_mixed_s": copy_mixed,
            "copy_mixed_GBps": total / copy_mixed / 1e9,
            "copy_mixed_over_alone": copy_alone / copy_mixed,
            "decode_call_mixed_s": compute_mixed,
            "decode_slowdown_mixed": compute_mixed / per_call,
            "copy_span_share_overlapped_by_compute": overlap,
            "zero_copy_calls_rotated": self.zero_copy_calls,
            "zero_copy_call_s": zero_copy,
            "zero_copy_GBps": self.top_k * nbytes / zero_copy / 1e9,
            "zero_copy_over_copy_alone": self.top_k * nbytes / zero_copy / (total / copy_alone),
            "zero_copy_variants": self.zero_copy_variants(total / copy_alone / 1e9),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--gb", type=float, default=1.5, help="GB copied per measurement (default 1.5)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "copy-overlap-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("copy_overlap.py measures CUDA streams and pinned memory: run it on a machine with a GPU")
    device = torch.device("cuda")
    result = {
        **result_header(" ".join(["python", "benchmarks/copy_overlap.py", *sys.argv[1:]]), device),
        "setup": {"scheme": "int8-shared", "activations": "bf16", "tokens": 1, "gb_per_copy_run": args.gb,
                  "copy": "Transfer.load on the prefetch stream, pinned host -> device rows",
                  "compute": f"CUDA graph of {GRAPH_CALLS} decode calls over resident experts, replayed"},
        "shapes": {},
    }
    timer = Timer(device, args.replays)
    for name in args.shapes.split(","):
        run = ShapeRun(name, args.gb, device, timer)
        figures = {**run.check(), **run.measure()}
        result["shapes"][name] = figures
        print(f"{name}: {json.dumps(figures)}", flush=True)
        del run
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def print_table(result: dict) -> None:
    print(f"\n{result['machine']}  {result['date']}  ({result['setup']['gb_per_copy_run']} GB copied per run)")
    head = ["shape", "copy GB/s", "mixed GB/s", "mixed/alone", "decode us", "mixed us", "overlap", "zero-copy GB/s",
            "zc/copy"]
    print("  ".join(f"{h:>14}" for h in head))
    for name, f in result["shapes"].items():
        cells = [name, f"{f['copy_alone_GBps']:.1f}", f"{f['copy_mixed_GBps']:.1f}", f"{f['copy_mixed_over_alone']:.2f}",
                 f"{f['decode_call_alone_s'] * 1e6:.1f}", f"{f['decode_call_mixed_s'] * 1e6:.1f}",
                 f"{f['copy_span_share_overlapped_by_compute']:.2f}", f"{f['zero_copy_GBps']:.1f}",
                 f"{f['zero_copy_over_copy_alone']:.2f}"]
        print("  ".join(f"{c:>14}" for c in cells))
    for name, f in result["shapes"].items():
        for variant, v in f.get("zero_copy_variants", {}).items():
            if "error" in v:
                print(f"  zero-copy {name}, {variant}: {v['error']}")
            else:
                print(f"  zero-copy {name}, {variant}: {v['zero_copy_GBps']:.1f} GB/s, "
                      f"{v['zero_copy_over_copy_alone']:.2f} of the copy")


if __name__ == "__main__":
    main()
