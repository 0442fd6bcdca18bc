"""The CPU worker as a process of its own, for a host that launches kernels meanwhile (DESIGN.md 2.8).

A worker thread takes the GIL back between its torch operations, so while it computes, the
host's launches and table updates wait for it and it waits for them (docs/design.md, "the GIL's
toll"). A child process has an interpreter of its own: `CpuExpertProcess` computes the same
`CpuJob`s as `CpuExpertWorker`'s thread, with the same executor, from the same memory. The expert
store and the host rows are buffers a child can map (mira.store.host_memory): nothing is copied
into it but a job's description.

One job is in flight at a time. The host sends an order over a pipe: the layer's experts, where
their blobs and the rows lie, and how many fills of the rows to wait for. Each fill posts the
rows' semaphore once its copies are done (`HostRows` with `posts`: on CUDA a host function behind
the copies, so no host thread waits for them). The child computes, posts the job's `done` (on
CUDA the stream's hold, mira.runtime.host_signal) and sends back its times, or its error. If the
child dies, a watcher thread posts the hold of the job in flight so the stream does not stall, and
the job's result raises.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
import traceback

import torch

from mira.kernels.cpu_experts import CpuExpertFFN
from mira.runtime.cpu_worker import CpuJob, HostRows, first_parallel_operation
from mira.runtime.host_signal import HostSignal
from mira.store.host_memory import SharedFile, SharedViews, shared_place

START_TIMEOUT_S = 120.0  # for the child to import torch and report ready


class JobReply:
    """A job's result from the process: the parts of a `concurrent.futures.Future` the hybrid
    path uses. Waiting for it reads the child's reply (with the GIL let go)."""

    def __init__(self, worker: CpuExpertProcess, job: CpuJob) -> None:
        self._worker = worker
        self._job = job
        self._error: BaseException | None = None
        self._received = False

    def done(self) -> bool:
        return self._received

    def result(self, timeout: float | None = None) -> torch.Tensor:
        """`job.out` once written.

        Raises:
            the child's error in the job; RuntimeError if the child has ended; TimeoutError.
        """
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._job.out

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The job's error once it is through (None if it succeeded)."""
        if not self._received:
            self._worker._receive(self, timeout)
        return self._error

    def _set(self, compute_s: float, finished: float, error: BaseException | None) -> None:
        self._job.compute_s, self._job.finished = compute_s, finished
        self._error, self._received = error, True


class CpuExpertProcess:
    """A child process with its own torch thread count, computing `CpuJob`s one at a time.

    Args:
        ffn: the CPU expert executor of the store's layout (a copy goes to the child).
        threads: torch compute threads of the child.

    Attributes:
        threads: the count the child runs with, read inside it.
        own_threads: always true: the child's count is its own.
        shares_gil: false: the host's work and the child's do not slow each other down.
    """

    own_threads = True
    shares_gil = False

    def __init__(self, ffn: CpuExpertFFN, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a CPU worker needs at least one thread, not {threads}")
        self.ffn = ffn
        self.rows_posted = HostSignal()  # posted by each fill of rows made by `host_rows`
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of the host's state
        self._conn, child_end = context.Pipe()
        file, place = shared_place(self.rows_posted.memory)
        self._process = context.Process(target=_child_main, args=(child_end, ffn, threads, file, place),
                                        name="mira-cpu-experts", daemon=True)
        self._process.start()
        child_end.close()
        self._closing = False
        self._in_flight: tuple[JobReply, CpuJob] | None = None
        self._files: set[int] = set()  # the uids of the files the child has mapped
        self._rows_files: frozenset[int] = frozenset()  # those of the last job's rows
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the CPU expert process did not start within {START_TIMEOUT_S:.0f} s")
        started = self._receive_message()
        if isinstance(started, BaseException):
            self._process.join()
            raise started
        self.threads = started
        threading.Thread(target=self._watch, name="mira-cpu-experts-watch", daemon=True).start()

    def host_rows(self, max_tokens: int, hidden_size: int, top_k: int, dtype: torch.dtype,
                  device: torch.device | str, weights_dtype: torch.dtype = torch.float32) -> HostRows:
        """Host rows for this process's jobs: each fill posts the child (see HostRows)."""
        return HostRows(max_tokens, hidden_size, top_k, dtype, device, weights_dtype, posts=self.rows_posted)

    def submit(self, job: CpuJob) -> JobReply:
        """Send `job` to the child (after the reply to the one before is read); its rows must come
        from `host_rows` and its blobs from shareable memory (the expert store)."""
        if self._closing or not self._process.is_alive():
            raise RuntimeError("the CPU expert process is closed")
        if self._in_flight is not None:
            self._in_flight[0].exception()
        places = []
        files = {}
        for tensor in (job.hidden, job.top_k_index, job.top_k_weights, job.out,
                       *(job.blobs[expert] for expert in job.experts)):
            if tensor is None:  # no blob: the child's executor says so
                places.append(None)
                continue
            file, place = shared_place(tensor)
            files[file.uid] = file
            places.append(place)
        rows_files = frozenset(place.uid for place in places[:4])
        dropped = tuple(self._rows_files - rows_files)
        self._rows_files = rows_files
        new = tuple(file for uid, file in files.items() if uid not in self._files)
        self._files.update(files)
        self._files.difference_update(dropped)
        done = shared_place(job.done.memory) if job.done is not None else None
        if done is not None and done[0].uid not in self._files:
            new += (done[0],)
            self._files.add(done[0].uid)
        reply = JobReply(self, job)
        self._in_flight = (reply, job)
        self._conn.send((tuple(job.experts), job.cut, job.copies, tuple(places), new, dropped,
                         done[1] if done is not None else None))
        return reply

    def close(self) -> None:
        """Let the child finish its job and stop."""
        if self._closing:
            return
        self._closing = True
        if self._in_flight is not None and self._process.is_alive():
            self._in_flight[0].exception()
        try:
            self._conn.send(None)
        except OSError:  # the child has gone already
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def __enter__(self) -> CpuExpertProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _receive(self, reply: JobReply, timeout: float | None) -> None:
        if self._conn.poll(timeout) is False:
            raise TimeoutError("the CPU expert process has not finished its job")
        try:
            message = self._receive_message()
        except (EOFError, OSError):
            message = (0.0, time.perf_counter(), RuntimeError(
                f"the CPU expert process ended (exit code {self._process.exitcode}) before finishing its job"))
        reply._set(*message)
        self._in_flight = None

    def _receive_message(self):
        return self._conn.recv()

    def _watch(self) -> None:
        """If the child dies with a job in flight, release the job's hold so the stream goes on."""
        multiprocessing.connection.wait([self._process.sentinel])
        in_flight = self._in_flight
        if not self._closing and in_flight is not None and in_flight[1].done is not None:
            in_flight[1].done.post()


def _child_main(conn, ffn: CpuExpertFFN, threads: int, rows_file: SharedFile, rows_place) -> None:
    """The child: set its threads, then compute orders until it gets None."""
    try:
        torch.set_num_threads(threads)
        first_parallel_operation()
        views = SharedViews()
        views.map(rows_file)
        rows_posted = HostSignal(views.view(rows_place))
    except BaseException as error:
        conn.send(_sendable(error))
        return
    conn.send(torch.get_num_threads())
    fills = 0  # posts of the rows taken so far
    signals: dict = {}  # done semaphores by place
    while (order := conn.recv()) is not None:
        experts, cut, copies, places, new, dropped, done = order
        for file in new:
            views.map(file)
        views.forget(dropped)
        while fills < copies:
            rows_posted.wait()
            fills += 1
        begin = time.perf_counter()
        error = None
        try:
            hidden, top_k_index, top_k_weights, out = (views.view(place) for place in places[:4])
            blobs: list[torch.Tensor | None] = [None] * (max(experts) + 1 if experts else 0)
            for expert, place in zip(experts, places[4:]):
                blobs[expert] = views.view(place) if place is not None else None
            ffn(hidden, top_k_index, top_k_weights, blobs, experts, out=out, cut=cut)
        except BaseException as failure:  # sent to the host, which raises it from the job's result
            error = _sendable(failure)
        compute_s = time.perf_counter() - begin
        if done is not None:
            if done not in signals:
                signals[done] = HostSignal(views.view(done))
            signals[done].post()
        conn.send((compute_s, time.perf_counter(), error))


def _sendable(error: BaseException) -> BaseException:
    """`error` if it pickles, else a RuntimeError with its traceback."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError("".join(traceback.format_exception(error)))

