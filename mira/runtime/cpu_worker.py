"""A thread that computes missed experts on the CPU while the GPU serves the others (DESIGN.md 2.8).

The GPU side copies a layer's hidden rows and routing into pinned host buffers (`HostRows.stage`,
non-blocking, with an event), hands the worker a `CpuJob` naming the experts the CPU computes,
launches its own kernel for the rest, and adds the worker's partial sum back on the device
(`HostRows.add_into`): on CUDA enqueued behind a hold that the job's `done` releases
(mira.runtime.host_signal), so the host need not wait; on the CPU after the job's future is done.
On a CPU-only run the same executor (`mira.kernels.cpu_experts.CpuExpertFFN`) is simply called in
place.

Threads. torch computes on the CPU through OpenMP (`torch.__config__.parallel_info()`: "ATen
parallel backend: OpenMP" in the Linux wheels), whose thread count is a setting of each calling
thread: a thread that starts parallel work gets a team of its own of that size, and two threads
computing at once do not share one pool. `torch.set_num_threads` sets the calling thread's count
and also the process-wide default that a thread takes on its first parallel operation (and MKL's
one count). So the worker sets its count and runs one parallel operation before it reports ready,
and the constructor then sets the caller's count again: the worker keeps its own, the caller and
threads started later keep theirs, and MKL (dense fp32 products only, not the INT8 path) follows
the caller's. With another parallel backend the counts are process-wide; `own_threads` says which
held. The caller's team, idle from here on where the GPU decodes, is let go
(mira.runtime.threads.free_idle_team): beside it the worker's threads would sleep between
operations. The worker releases the GIL inside each product but takes it between them, so its
Python steps (a few per expert) interleave with the caller's.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from mira.kernels.cpu_experts import CpuExpertFFN
from mira.runtime.threads import free_idle_team


@dataclass
class CpuJob:
    """One layer's experts for the CPU.

    Attributes:
        layer_position: the MoE layer (for telemetry).
        experts: the experts the CPU computes (ascending ids).
        hidden: [T, H] token states in host memory.
        top_k_index: [T, K] routed expert ids in host memory.
        top_k_weights: [T, K] routing weights in host memory.
        blobs: length E, the host-store blob of every expert in `experts`.
        out: [T, H] host tensor the partial sum is written into (every row).
        ready: a CUDA event recorded after the copies that fill the host tensors (None on the CPU).
        done: called by the worker once it is through with the job, whether it failed or not.
        cut: (expert, first): that expert of `experts` from intermediate unit `first` on only (the
            device computes the units below); None: every expert whole.
        compute_s: set by the worker: seconds from the rows being ready to the partial sum written.
        finished: set by the worker: `time.perf_counter()` when it was through.
    """

    layer_position: int
    experts: Sequence[int]
    hidden: torch.Tensor
    top_k_index: torch.Tensor
    top_k_weights: torch.Tensor
    blobs: Sequence[torch.Tensor | None]
    out: torch.Tensor
    ready: torch.cuda.Event | None = None
    done: Callable[[], None] | None = None
    cut: tuple[int, int] | None = None
    compute_s: float = 0.0
    finished: float = 0.0


class CpuExpertWorker:
    """One thread with its own torch thread count, computing `CpuJob`s in the order submitted.

    Args:
        ffn: the CPU expert executor of the store's layout.
        threads: torch compute threads of the worker.

    Attributes:
        threads: the count the worker's thread runs with, read inside it.
        own_threads: whether the caller's count stayed its own (true under OpenMP).
    """

    def __init__(self, ffn: CpuExpertFFN, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a CPU worker needs at least one thread, not {threads}")
        self.ffn = ffn
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        caller_threads = torch.get_num_threads()
        started: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(threads, started), name="mira-cpu-experts",
                                        daemon=True)
        self._thread.start()
        self.threads = started.result()
        torch.set_num_threads(caller_threads)  # the default for others again (see the module docstring)
        kept = self.call(torch.get_num_threads).result() == self.threads
        self.own_threads = kept and torch.get_num_threads() == caller_threads
        free_idle_team()

    def submit(self, job: CpuJob) -> Future:
        """Queue `job`; the future's result is `job.out` once written."""
        return self.call(self._compute, job)

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the worker's thread (with its thread count), after the jobs queued before."""
        if not self._thread.is_alive():
            raise RuntimeError("the CPU expert worker is closed")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """Finish the queued jobs and stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def __enter__(self) -> CpuExpertWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _compute(self, job: CpuJob) -> torch.Tensor:
        try:
            if job.ready is not None:
                job.ready.synchronize()  # blocks this thread only, with the GIL released
            begin = time.perf_counter()
            out = self.ffn(job.hidden, job.top_k_index, job.top_k_weights, job.blobs, job.experts, out=job.out,
                           cut=job.cut)
            job.compute_s = time.perf_counter() - begin
            return out
        finally:
            job.finished = time.perf_counter()
            if job.done is not None:
                job.done()

    def _run(self, threads: int, started: Future) -> None:
        try:
            torch.set_num_threads(threads)
            _first_parallel_operation()
        except BaseException as error:  # the constructor raises it
            started.set_exception(error)
            return
        started.set_result(torch.get_num_threads())
        while (item := self._jobs.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)


def _first_parallel_operation() -> None:
    """An operation that enters torch's parallel loop whatever its size (elementwise ones run serially
    below a grain size and never get there), so this thread's count is fixed now."""
    torch._weight_int8pack_mm(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.int8),
                              torch.ones(4, dtype=torch.bfloat16))


class HostRows:
    """The host buffers of one layer's CPU share and their copies to and from the device.

    `stage` copies the hidden rows and routing of a call into pinned buffers (non-blocking on
    CUDA, with an event for the worker to wait on) and makes the job (or `copy_in`, then `job`);
    `add_into` adds the worker's partial sum into the layer's output on the device. Both enqueue on
    the current stream, so a job's event also follows the previous job's return copy: the worker
    never overwrites `out` before that copy has read it. One job per buffer set is in flight at a
    time.

    Args:
        max_tokens: most tokens of one call (T).
        hidden_size: H.
        top_k: K.
        dtype: the hidden states' dtype.
        device: where the layer runs.
        weights_dtype: the routing weights' dtype (kept as they come: a copy that also converts
            would make a device temporary on every call).
    """

    def __init__(self, max_tokens: int, hidden_size: int, top_k: int, dtype: torch.dtype,
                 device: torch.device | str, weights_dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.hidden = torch.empty(max_tokens, hidden_size, dtype=dtype, pin_memory=cuda)  # [T, H]
        self.top_k_index = torch.empty(max_tokens, top_k, dtype=torch.int64, pin_memory=cuda)  # [T, K]
        self.top_k_weights = torch.empty(max_tokens, top_k, dtype=weights_dtype, pin_memory=cuda)  # [T, K]
        self.out = torch.empty(max_tokens, hidden_size, dtype=torch.float32, pin_memory=cuda)  # [T, H] partial sums
        self._device_out = torch.empty(max_tokens, hidden_size, dtype=torch.float32, device=self.device) if cuda \
            else None
        self._staged = torch.cuda.Event() if cuda else None

    def stage(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              layer_position: int, experts: Sequence[int], blobs: Sequence[torch.Tensor | None],
              done: Callable[[], None] | None = None, cut: tuple[int, int] | None = None) -> CpuJob:
        """A job for `experts` (one of them `cut`, see CpuJob) on this call's rows, copied here
        without a host sync (the previous job must be done: its event is recorded again)."""
        self.copy_in(hidden, top_k_index, top_k_weights)
        return self.job(hidden.shape[0], layer_position, experts, blobs, done, cut)

    def copy_in(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """This call's rows copied here without a host sync, the event recorded behind them (the
        previous job must be done)."""
        T = hidden.shape[0]
        if T > self.hidden.shape[0]:
            raise ValueError(f"a call of {T} tokens exceeds the {self.hidden.shape[0]} these host rows hold")
        for dst, src in zip((self.hidden, self.top_k_index, self.top_k_weights), (hidden, top_k_index, top_k_weights)):
            dst[:T].copy_(src, non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def job(self, tokens: int, layer_position: int, experts: Sequence[int], blobs: Sequence[torch.Tensor | None],
            done: Callable[[], None] | None = None, cut: tuple[int, int] | None = None) -> CpuJob:
        """A job for `experts` (one of them `cut`, see CpuJob) on the first `tokens` rows `copy_in` last copied."""
        rows = (self.hidden[:tokens], self.top_k_index[:tokens], self.top_k_weights[:tokens])
        return CpuJob(layer_position, experts, *rows, blobs, self.out[:tokens], self._staged, done, cut)

    def add_into(self, out: torch.Tensor, job_out: torch.Tensor) -> torch.Tensor:
        """out [T, H] += the worker's partial sum `job_out`, on the current stream: on the CPU once the
        job's future is done; on CUDA behind a hold that the job's `done` releases."""
        T = out.shape[0]
        if self._device_out is None:
            return out.add_(job_out)
        partial = self._device_out[:T]
        partial.copy_(job_out, non_blocking=True)
        return out.add_(partial)
