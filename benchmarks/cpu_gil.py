"""What the GIL costs the CPU worker while the host thread runs Python (mira.runtime.hybrid).

The CPU worker computes one expert per job from a host blob (int8-shared, SiLU-gated), timed in
its own thread, in three settings of the host (this) thread:

  idle        the host waits for the job
  launching   the host runs a loop shaped like eager decoding: a few small torch operations
              (each lets the GIL go) between short stretches of pure Python (which hold it);
              the loop calibration runs beside the timed CPU (mira.runtime.calibrate.keep_host_busy)
  spinning    the host runs pure Python only (it lets the GIL go at the switch interval alone)

and in four forms of the job:

  python      one int8-shared expert computed operation by operation as the executor does
              (mira.kernels.cpu_experts; its operations written out here, in one function that
              TorchScript can also compile), each operation giving the GIL up and taking it back
  scripted    that function as TorchScript, which holds no GIL while it runs
  python+switch  the python form with the interpreter's switch interval at --switch-s
  process     the python form in a child process over a copy of the blobs in shared memory: an
              interpreter, and a GIL, of its own (what a worker process would gain)

Each figure: median and range over --repeats passes of --calls jobs over distinct blobs (a pass
through --spread-gb of experts, so that no CPU cache holds a blob from the call before). Every
cell runs one pass per round, so that a machine drifting over the run shifts all cells alike.

    python benchmarks/cpu_gil.py --threads 15 [--shape 4096x14336] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import blobs_for, layout_for, shape_config, summary, write_result  # noqa: E402

from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.runtime.calibrate import keep_host_busy  # noqa: E402
from mira.runtime.cpu_worker import CpuExpertWorker  # noqa: E402


def _one_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scale: torch.Tensor, unit: torch.Tensor,
                weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The executor's int8-shared expert on x [1, H], weighted into out [1, H] (float32)."""
    gate_up = torch._weight_int8pack_mm(x.to(torch.bfloat16) * scale, w13, unit).float()  # [1, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._weight_int8pack_mm((F.silu(gate) * up).to(torch.bfloat16), w2, scale)  # [1, H]
    return out.copy_(y.float() * weight)


def _scripted_jobs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(_one_expert)


def host_spinning(future: Future) -> None:
    while not future.done():
        sum(range(200))


def job_pass(job, views: list[dict], x: torch.Tensor, unit: torch.Tensor, calls: int) -> float:
    """Mean seconds per job over `calls` distinct blobs (runs on the worker)."""
    weight = torch.ones(1, 1)
    out = torch.empty(1, x.shape[1])
    start = time.perf_counter()
    for i in range(calls):
        v = views[i % len(views)]
        job(x, v["w13"], v["w2"], v["scale"], unit, weight, out)
    return (time.perf_counter() - start) / calls


def _process_main(conn, views: list[dict], x: torch.Tensor, unit: torch.Tensor, threads: int) -> None:
    """The child's loop: a pass of that many jobs per request, its mean seconds sent back."""
    torch.set_num_threads(threads)
    while (calls := conn.recv()) is not None:
        conn.send(job_pass(_one_expert, views, x, unit, calls))


class ProcessWorker:
    """The python form's passes in a child process, over the blobs copied once into shared memory."""

    def __init__(self, layout, blobs: list[torch.Tensor], x: torch.Tensor, unit: torch.Tensor, threads: int):
        shared = torch.empty(len(blobs), layout.nbytes, dtype=torch.uint8).share_memory_()  # [blobs, bytes]
        for row, blob in zip(shared, blobs):
            row.copy_(blob)
        context = torch.multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_process_main, daemon=True,
                                        args=(child, [layout.views(row) for row in shared], x, unit, threads))
        self._process.start()

    def call(self, calls: int) -> Future:
        """A pass of `calls` jobs; the future's result is its mean seconds per job (a thread of this
        process waits for the reply, its GIL let go meanwhile)."""
        future: Future = Future()
        self._conn.send(calls)
        threading.Thread(target=lambda: future.set_result(self._conn.recv()), daemon=True).start()
        return future

    def close(self) -> None:
        self._conn.send(None)
        self._process.join()


def measure_pass(future: Future, host: str) -> float:
    """Microseconds per job of the pass `future` stands for, with the host (this thread) `host`."""
    if host == "launching":
        keep_host_busy(future)
    elif host == "spinning":
        host_spinning(future)
    return future.result() * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads of the CPU worker")
    parser.add_argument("--shape", default="mixtral-8x7b", help="a preset of mira.bench.synthetic or HxI")
    parser.add_argument("--spread-gb", type=float, default=1.0, help="distinct blob bytes cycled through")
    parser.add_argument("--calls", type=int, default=32, help="jobs per pass")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--switch-s", type=float, default=1e-4, help="the switch interval of python+switch")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-gil.json")
    args = parser.parse_args()
    config = shape_config(args.shape)
    layout = layout_for(config, "int8-shared")
    cuda = torch.cuda.is_available()
    store, blobs = blobs_for(config, layout, args.spread_gb * 1e9, pin=cuda)
    ffn = CpuExpertFFN(layout, F.silu)
    views = [ffn.views(blob) for blob in blobs]
    x = torch.randn(1, layout.hidden).to(torch.bfloat16)
    unit = torch.ones(2 * layout.intermediate, dtype=torch.bfloat16)
    jobs = {"python": _one_expert, "scripted": _scripted_jobs(), "python+switch": _one_expert}
    default_switch = sys.getswitchinterval()
    results: dict = {}
    cells = [(name, host) for name in (*jobs, "process") for host in ("idle", "launching", "spinning")]
    runs: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    child = ProcessWorker(layout, blobs, x, unit, args.threads)
    with CpuExpertWorker(ffn, args.threads) as worker:
        for job in jobs.values():  # first calls (scripting's profiling runs) untimed
            worker.call(job_pass, job, views[:2], x, unit, 4).result()
        child.call(4).result()
        for _ in range(args.repeats):  # every cell once per round: drift over the run falls on all alike
            for name, host in cells:
                sys.setswitchinterval(args.switch_s if name == "python+switch" else default_switch)
                future = child.call(args.calls) if name == "process" else \
                    worker.call(job_pass, jobs[name], views, x, unit, args.calls)
                runs[name, host].append(measure_pass(future, host))
        sys.setswitchinterval(default_switch)
    child.close()
    for name, host in cells:
        row = results.setdefault(name, {})[host] = summary(runs[name, host])
        print(f"{name:14s} host {host:9s} {row['median']:10.1f} us per expert "
              f"({row['min']:.1f}-{row['max']:.1f})", flush=True)
    write_result(args.out, {"shape": args.shape, "hidden": layout.hidden, "intermediate": layout.intermediate,
                            "blob_bytes": layout.nbytes, "distinct_blobs": len(blobs), "threads": worker.threads,
                            "switch_s": {"default": default_switch, "python+switch": args.switch_s},
                            "repeats": args.repeats, "calls": args.calls, "us_per_expert": results},
                 "cuda" if cuda else None)
    del store


if __name__ == "__main__":
    main()
