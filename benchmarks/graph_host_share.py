"""The CPU's share of a MoE layer inside a replayed CUDA graph: what the host round trip costs a layer.

Decoding replays a captured graph per step on the small shapes (mira.runtime.graphs), and the CPU's
share needs the host between a layer's routing and its output, so today it runs eagerly. This measures
the share's floor under replay. Each of --layers layers is captured as: the hidden row copied to
pinned memory; a host node that posts the worker's semaphore (libc's sem_post as the CUhostFn); a hold
(mira.runtime.host_signal) until the worker has written its sum; that sum copied back and added. The
worker, a Python thread of --threads torch threads, waits on its semaphore with the GIL released,
computes n experts of the shape on distinct synthetic blobs (mira.kernels.cpu_experts), writes the
sum to pinned memory and releases the hold. Per layer, median and range over --repeats passes:

  copies_us     the two copies and the add, no host node
  experts_us    with the host nodes, n experts a layer, for n in --experts (0: the round trip alone)
  cpu_us        n experts called with no graph around them, in a thread of as many torch threads

    python benchmarks/graph_host_share.py --threads 15 [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--experts 0,1,2,4]
        [--layers 48] [--steps 20] [--repeats 5] [--out benchmarks/results/graph-host-share-h200.json]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
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
from mira.runtime.host_signal import SEM_T_BYTES, HostSignal, launch_host_func  # noqa: E402

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)  # its calls let the GIL go
LIBC.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
LIBC.sem_wait.argtypes = [ctypes.c_void_p]


class Worker:
    """A thread that computes `n` experts each time a host node posts its request, then releases `done`."""

    def __init__(self, ffn: CpuExpertFFN, blobs: list[torch.Tensor], threads: int, hidden: int) -> None:
        self.ffn, self.threads, self.n = ffn, threads, 0
        self.views = [ffn.layout.views(blob) for blob in blobs]
        self.rows = torch.zeros(1, hidden, dtype=torch.bfloat16).pin_memory()  # the layer's hidden row
        self.out = torch.zeros(1, hidden, dtype=torch.bfloat16).pin_memory()  # the CPU's sum
        self.request = ctypes.create_string_buffer(SEM_T_BYTES)
        if LIBC.sem_init(self.request, 0, 0):
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self.done = HostSignal()
        self.stopping = False
        self._next = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def experts(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The sum of n experts on x, each on the next distinct blob."""
        total = torch.zeros(x.shape, dtype=torch.float32)
        for _ in range(n):
            total += self.ffn.expert(x, self.views[self._next]).float()
            self._next = (self._next + 1) % len(self.views)
        return total

    def _serve(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            LIBC.sem_wait(self.request)
            if self.stopping:
                return
            self.out.copy_(self.experts(self.rows, self.n))
            self.done.post()

    def stop(self) -> None:
        self.stopping = True
        LIBC.sem_post(self.request)
        self._thread.join()


def _post_launcher():
    """A graph node that wakes the worker: cuLaunchHostFunc with libc's sem_post as the host function."""
    launch, post = launch_host_func(), ctypes.cast(LIBC.sem_post, ctypes.c_void_p)
    return lambda stream, sem: launch(ctypes.c_void_p(stream.cuda_stream), post, ctypes.cast(sem, ctypes.c_void_p))


def capture(worker: Worker, layers: int, host_nodes: bool) -> torch.cuda.CUDAGraph:
    """A graph of `layers` layers: the row to the host, (the worker's round trip), its sum back, added."""
    launch = _post_launcher()
    x = torch.randn(1, worker.rows.shape[1], dtype=torch.bfloat16, device="cuda")
    back, acc = torch.empty_like(x), torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream()
        for _ in range(layers):
            worker.rows.copy_(x, non_blocking=True)
            if host_nodes:
                if launch(stream, worker.request):
                    raise RuntimeError("cuLaunchHostFunc failed")
                worker.done.hold(stream)
            back.copy_(worker.out, non_blocking=True)
            acc.add_(back)
    graph.keep = (x, back, acc)  # the graph's buffers live as long as it
    return graph


def replay_pass(graph: torch.cuda.CUDAGraph, steps: int, layers: int) -> float:
    """Mean seconds per layer over `steps` replays."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (steps * layers)


def cpu_pass(worker: Worker, n: int, calls: int) -> float:
    """Mean seconds per call of n experts, in a thread of the worker's threads (no graph)."""
    seconds: list[float] = []

    def run() -> None:
        torch.set_num_threads(worker.threads)
        worker.experts(worker.rows, n)  # first call outside the timing
        start = time.perf_counter()
        for _ in range(calls):
            worker.experts(worker.rows, n)
        seconds.append((time.perf_counter() - start) / calls)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seconds[0]


def measure(name: str, args) -> dict:
    config = shape_config(name)
    layout = layout_for(config, "int8-shared")
    store, blobs = blobs_for(config, layout, args.spread_gb * 1e9, pin=True)
    worker = Worker(CpuExpertFFN(layout, F.silu), blobs, args.threads, layout.hidden)
    try:
        result = {"hidden": layout.hidden, "intermediate": layout.intermediate, "blob_bytes": layout.nbytes,
                  "distinct_blobs": len(blobs)}
        plain = capture(worker, args.layers, host_nodes=False)
        replay_pass(plain, 2, args.layers)
        result["copies_us"] = summary([replay_pass(plain, args.steps, args.layers) * 1e6 for _ in range(args.repeats)])
        shared = capture(worker, args.layers, host_nodes=True)
        result["experts"] = {}
        for n in args.experts:
            worker.n = n
            replay_pass(shared, 2, args.layers)
            row = {"experts_us": summary([replay_pass(shared, args.steps, args.layers) * 1e6
                                          for _ in range(args.repeats)]),
                   "cpu_us": summary([cpu_pass(worker, n, args.steps * 4) * 1e6 for _ in range(args.repeats)])}
            result["experts"][str(n)] = row
            print(f"{name:16s} {n} experts  replayed {row['experts_us']['median']:8.1f} us a layer  "
                  f"(copies alone {result['copies_us']['median']:6.1f})  "
                  f"outside a graph {row['cpu_us']['median']:8.1f} us")
    finally:
        worker.stop()
    result["page_locked"] = store.data.is_pinned()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads of the CPU worker")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b", help="presets, comma-separated")
    parser.add_argument("--experts", default="0,1,2,4", help="experts the worker computes a layer, comma-separated")
    parser.add_argument("--layers", type=int, default=48, help="layers captured in the graph")
    parser.add_argument("--steps", type=int, default=20, help="replays a pass")
    parser.add_argument("--repeats", type=int, default=5, help="passes a figure (>= 3)")
    parser.add_argument("--spread-gb", type=float, default=2.0, help="distinct expert bytes the worker cycles through")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/graph-host-share-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it replays CUDA graphs")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (a median and a range)")
    args.experts = [int(n) for n in args.experts.split(",")]
    shapes = {name: measure(name, args) for name in args.shapes.split(",")}
    write_result(args.out, {"threads": args.threads, "layers": args.layers, "steps": args.steps,
                            "repeats": args.repeats, "spread_gb": args.spread_gb, "shapes": shapes},
                 "cuda")


if __name__ == "__main__":
    main()
