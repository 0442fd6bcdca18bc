"""The CPU's share of a MoE layer inside a replayed CUDA graph: what the host round trip costs a layer.

Decoding replays a captured graph per step on the small shapes (mira.runtime.graphs), and the CPU's
share needs the host between a layer's routing and its output: the inline share runs eagerly, while
`--cpu-experts graph` keeps the step replayed. This measures the share's floor under replay, signalled
two ways. Each of --layers layers is captured as: the hidden row copied to pinned memory; a signal to
the CPU; a wait until it has written its sum; that sum copied back and added.

- Host functions: a host node posts the worker's semaphore (libc's sem_post as the CUhostFn) and a
  hold (mira.runtime.host_signal) waits. The worker, a Python thread of --threads torch threads,
  waits on its semaphore with the GIL released.
- Stream memory operations: the runtime's own exchange with CPU lanes (mira.runtime.mailbox,
  mira.runtime.cpu_lanes, as `--cpu-experts graph` runs it). The graph copies the row and the
  choice to pinned memory and raises each lane's flag (cuStreamWriteValue64, after a memory
  barrier), then waits for the lanes' flags (cuStreamWaitValue64); no host node, no CUDA callback
  thread. The lanes poll, letting the GIL go at each look; with L lanes (--lanes) the experts are
  dealt to L threads of threads / L torch threads each.

The CPU computes n experts of the shape on distinct synthetic blobs (mira.kernels.cpu_experts) and
writes the sum to pinned memory. After each timing, one replay's sum on the device is checked against
what the CPU wrote (host functions) or against the same experts computed here (lanes). Per layer,
median and range over --repeats passes:

  copies_us     host functions' two copies and the add, no signal
  experts_us    host functions, n experts a layer, for n in --experts (0: the round trip alone)
  memop_us      stream memory operations, per lane count
  split         a layer of --misses misses: all read by the device (device_alone_us: the blobs copied to
                the device in the graph, no exchange), then n of them (--cpu-shares) computed by the
                lanes while the device reads the rest, per lane count
  cpu_us        n experts called with no graph around them, in a thread of as many torch threads

    python benchmarks/graph_host_share.py --threads 15 [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--experts 0,1,2,4]
        [--lanes 1,2] [--misses 6] [--cpu-shares 1,2,3] [--layers 48] [--steps 20] [--repeats 5]
        [--out benchmarks/results/graph-host-share-memops-h200.json]
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
from mira.runtime.cpu_lanes import CpuLanes  # noqa: E402
from mira.runtime.host_signal import SEM_T_BYTES, HostSignal, launch_host_func  # noqa: E402
from mira.runtime.mailbox import Mailbox  # noqa: E402

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
        self.written = torch.zeros(1, hidden)  # every sum written since `written` was zeroed, in float32
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
            self.written += self.out
            self.done.post()

    def stop(self) -> None:
        self.stopping = True
        LIBC.sem_post(self.request)
        self._thread.join()


class LaneExchange:
    """The runtime's exchange with the CPU lanes (mira.runtime.mailbox, mira.runtime.cpu_lanes), over
    `layers` stand-in layers of `width` distinct blobs each; a call computes its layer's first n
    (`set_experts`, read by the graph at replay)."""

    def __init__(self, layout, blobs: list[torch.Tensor], threads: int, layers: int, width: int, lanes: int) -> None:
        self.layout, self.n = layout, 0
        width = max(1, width)
        self.layers = [[blobs[(layer * width + j) % len(blobs)] for j in range(width)] for layer in range(layers)]
        self.box = Mailbox(lanes, layout.hidden, width, torch.bfloat16, torch.float32, torch.device("cuda"))
        self.lanes = CpuLanes(lambda: CpuExpertFFN(layout, F.silu), self.layers, self.box, threads)
        self.ids = torch.full((1, width), -1, dtype=torch.int64, device="cuda")  # [1, K]: the CPU's experts
        self.weights = torch.ones(1, width, device="cuda")

    def set_experts(self, n: int) -> None:
        ids = torch.full(self.ids.shape, -1, dtype=torch.int64)
        ids[0, :n] = torch.arange(n)
        self.ids.copy_(ids)
        self.n = n

    def expected(self, x: torch.Tensor) -> torch.Tensor:
        """What one replay adds: every layer's first n experts on x [1, H], summed in float32."""
        ffn = CpuExpertFFN(self.layout, F.silu)
        total = torch.zeros(x.shape)
        for blobs in self.layers:
            for blob in blobs[:self.n]:
                total += ffn.expert(x, self.layout.views(blob)).float()
        return total

    def stop(self) -> None:
        self.lanes.close()


def capture_exchange(exchange: LaneExchange, device_reads: list[list[torch.Tensor]] | None = None,
                     signal: bool = True) -> torch.cuda.CUDAGraph:
    """A graph of the exchange's layers: each posts its call to the lanes (mira.runtime.mailbox.Mailbox.
    post), then copies `device_reads[layer]` (pinned blobs) to the device, as the device's own misses
    would be read over PCIe while the CPU computes, then adds the lanes' sums (`collect`); `signal`
    False leaves the exchange out (those reads alone)."""
    layers = len(exchange.layers)
    x = torch.randn(1, exchange.layout.hidden, dtype=torch.bfloat16, device="cuda")
    acc = torch.zeros(x.shape, device="cuda")
    reads = device_reads or [[] for _ in range(layers)]
    width = max(len(blobs) for blobs in reads)
    scratch = torch.empty(width, reads[0][0].numel() if width else 0, dtype=torch.uint8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            if signal:
                exchange.box.post(layer, x, exchange.ids, exchange.weights)
            for row, blob in enumerate(reads[layer]):
                scratch[row].copy_(blob, non_blocking=True)
            if signal:
                exchange.box.collect(acc)
    graph.keep = (x, scratch, acc)  # the graph's buffers live as long as it
    return graph


def check_exchange(graph: torch.cuda.CUDAGraph, exchange: LaneExchange) -> None:
    """One replay's sum on the device equals the lanes' experts computed here (none lost, none stale).

    Raises:
        AssertionError: they differ.
    """
    x, _, acc = graph.keep
    torch.cuda.synchronize()
    acc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    exchange.lanes.check()
    expected = exchange.expected(x.cpu())
    if not torch.allclose(acc.cpu(), expected, rtol=1e-3, atol=1e-3 * max(expected.abs().max().item(), 1e-30)):
        raise AssertionError(f"the replayed sum differs from the lanes': {(acc.cpu() - expected).abs().max().item()}")


def layer_reads(blobs: list[torch.Tensor], layers: int, count: int) -> list[list[torch.Tensor]]:
    """`count` distinct blobs a layer, a different set for each layer."""
    return [[blobs[(layer * count + i) % len(blobs)] for i in range(count)] for layer in range(layers)]


def check_sums(graph: torch.cuda.CUDAGraph, worker: Worker) -> None:
    """One replay's sum on the device equals the sums the host-function worker wrote (none lost, none stale).

    Raises:
        AssertionError: they differ.
    """
    acc = graph.keep[-1]
    torch.cuda.synchronize()
    acc.zero_()
    worker.written.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = worker.written.sum(0, keepdim=True)
    if not torch.allclose(acc.cpu(), expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item()):
        raise AssertionError(f"the replayed sum differs from the worker's: {(acc.cpu() - expected).abs().max().item()}")


def _post_launcher():
    """A graph node that wakes the worker: cuLaunchHostFunc with libc's sem_post as the host function."""
    launch, post = launch_host_func(), ctypes.cast(LIBC.sem_post, ctypes.c_void_p)
    return lambda stream, sem: launch(ctypes.c_void_p(stream.cuda_stream), post, ctypes.cast(sem, ctypes.c_void_p))


def capture(worker: Worker, layers: int, host_nodes: bool) -> torch.cuda.CUDAGraph:
    """A graph of `layers` layers: the row to the host, (the worker's round trip), its sum back, added."""
    launch = _post_launcher()
    x = torch.randn(1, worker.rows.shape[1], dtype=torch.bfloat16, device="cuda")
    back, acc = torch.empty_like(x), torch.zeros(x.shape, device="cuda")
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


def timed(graph: torch.cuda.CUDAGraph, args) -> dict:
    """Per layer: one untimed pass, then --repeats passes of --steps replays."""
    replay_pass(graph, 2, args.layers)
    return summary([replay_pass(graph, args.steps, args.layers) * 1e6 for _ in range(args.repeats)])


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
    result = {"hidden": layout.hidden, "intermediate": layout.intermediate, "blob_bytes": layout.nbytes,
              "distinct_blobs": len(blobs), "experts": {str(n): {"memop_us": {}} for n in args.experts}}
    worker = Worker(CpuExpertFFN(layout, F.silu), blobs, args.threads, layout.hidden)
    try:
        result["copies_us"] = timed(capture(worker, args.layers, host_nodes=False), args)
        shared = capture(worker, args.layers, host_nodes=True)
        for n in args.experts:
            worker.n = n
            row = result["experts"][str(n)]
            row["experts_us"] = timed(shared, args)
            check_sums(shared, worker)
            row["cpu_us"] = summary([cpu_pass(worker, n, args.steps * 4) * 1e6 for _ in range(args.repeats)])
    finally:
        worker.stop()
    result["split"] = {"misses": args.misses, "cpu": {str(n): {} for n in args.cpu_shares}}
    width = max(args.experts + args.cpu_shares)
    for lanes in args.lanes:
        exchange = LaneExchange(layout, blobs, args.threads, args.layers, width, lanes)
        try:
            polled = capture_exchange(exchange)
            for n in args.experts:
                exchange.set_experts(n)
                result["experts"][str(n)]["memop_us"][str(lanes)] = timed(polled, args)
                check_exchange(polled, exchange)
            if "device_alone_us" not in result["split"]:
                alone = capture_exchange(exchange, layer_reads(blobs, args.layers, args.misses), signal=False)
                result["split"]["device_alone_us"] = timed(alone, args)
            for n in args.cpu_shares:
                exchange.set_experts(n)
                split = capture_exchange(exchange, layer_reads(blobs, args.layers, args.misses - n))
                result["split"]["cpu"][str(n)][str(lanes)] = timed(split, args)
                check_exchange(split, exchange)
        finally:
            exchange.stop()
    for n, row in result["experts"].items():
        memops = "  ".join(f"{lanes} lane(s) {figure['median']:7.1f}" for lanes, figure in row["memop_us"].items())
        print(f"{name:16s} {n} experts  host functions {row['experts_us']['median']:7.1f} us a layer  "
              f"memory operations {memops}  (copies alone {result['copies_us']['median']:5.1f})  "
              f"outside a graph {row['cpu_us']['median']:7.1f} us")
    split = result["split"]
    alone = split["device_alone_us"]["median"]
    print(f"{name:16s} {args.misses} misses a layer, all read by the device: {alone:7.1f} us")
    for n, row in split["cpu"].items():
        figures = "  ".join(f"{lanes} lane(s) {figure['median']:7.1f}" for lanes, figure in row.items())
        print(f"{name:16s}   {n} computed by the CPU meanwhile: {figures}")
    result["page_locked"] = store.data.is_pinned()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads of the CPU worker")
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b", help="presets, comma-separated")
    parser.add_argument("--experts", default="0,1,2,4", help="experts the worker computes a layer, comma-separated")
    parser.add_argument("--lanes", default="1,2", help="lane counts of the polling worker, comma-separated")
    parser.add_argument("--misses", type=int, default=6, help="misses a layer in the split timings")
    parser.add_argument("--cpu-shares", default="1,2,3", help="of those, the CPU's, comma-separated")
    parser.add_argument("--layers", type=int, default=48, help="layers captured in the graph")
    parser.add_argument("--steps", type=int, default=20, help="replays a pass")
    parser.add_argument("--repeats", type=int, default=5, help="passes a figure (>= 3)")
    parser.add_argument("--spread-gb", type=float, default=2.0, help="distinct expert bytes the worker cycles through")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/graph-host-share-memops-h200.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it replays CUDA graphs")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (a median and a range)")
    args.experts = [int(n) for n in args.experts.split(",")]
    args.lanes = [int(n) for n in args.lanes.split(",")]
    args.cpu_shares = [int(n) for n in args.cpu_shares.split(",")]
    if min(args.cpu_shares) < 0 or max(args.cpu_shares) > args.misses:
        parser.error(f"--cpu-shares must be between 0 and --misses ({args.misses})")
    if min(args.lanes) < 1 or max(args.lanes) > args.threads:
        parser.error(f"--lanes must be between 1 and --threads ({args.threads})")
    shapes = {name: measure(name, args) for name in args.shapes.split(",")}
    write_result(args.out, {"threads": args.threads, "lanes": args.lanes, "misses": args.misses,
                            "cpu_shares": args.cpu_shares, "layers": args.layers, "steps": args.steps,
                            "repeats": args.repeats, "spread_gb": args.spread_gb, "shapes": shapes},
                 "cuda")


if __name__ == "__main__":
    main()
