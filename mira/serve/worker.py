"""One generation at a time on the device: a thread that runs the server's requests in arrival order,
a bounded number waiting behind it, each cancellable, its text handed back to the event loop in
batches (mira.serve.relay)."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from mira.runtime.engine import MiraModel
from mira.runtime.generate import GenerationReport, SamplingConfig, stream_generate
from mira.serve.metrics import Metrics
from mira.serve.relay import Relay


STREAMED = ("text", "logprob")  # a streaming job's events before its last


class ShuttingDown(Exception):
    """The server is stopping: the job was cancelled, or refused before it queued."""

    def __init__(self):
        super().__init__("the server is shutting down; send the request again once it is back")


class QueueFull(Exception):
    """Every place in the queue is taken; `retry_after` seconds is a guess at when one frees."""

    def __init__(self, retry_after: int):
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Job:
    """One request's generation. Its events, in order: ("text", piece) and, when it asks for log-
    probabilities, ("logprob", TokenLogprob) any number of times when it streams, then ("done",
    GenerationReport) or ("error", exception); the event loop takes them in batches. Setting
    `cancel` ends it at its next step, or before it starts."""

    input_ids: torch.Tensor  # [1, T]
    sampling: SamplingConfig
    stream: bool
    events: Relay[tuple[str, object]]
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def send(self, kind: str, value) -> None:
        """Hand an event to the event loop (called from the device thread); the last goes at once."""
        self.events.put((kind, value))
        if kind not in STREAMED:
            self.events.flush()


class DeviceWorker:
    """Runs jobs one at a time on `model` in a thread of its own; at most `max_waiting` wait. A streamed
    job's text reaches the event loop at most every `stream_interval_s` seconds, and all of it as soon as
    its generation ends."""

    def __init__(self, model: MiraModel, max_waiting: int, metrics: Metrics, stream_interval_s: float):
        self.model = model
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.stream_interval_s = stream_interval_s
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not finished: the one running plus those waiting
        self._mean_job_s = 1.0  # running mean of how long a job holds the device, for Retry-After
        self._current: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mira-device", daemon=True)

    @property
    def pending(self) -> int:
        return self._pending

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Refuse new jobs and end what waits or runs, each in ShuttingDown, the running one at its next
        step (the server is stopping). Takes no lock: a signal handler calls it, perhaps while the
        thread it interrupted holds the queue's."""
        self._stopping = True  # before reading the running job: one that starts later sees it
        running = self._current
        if running is not None:
            running.cancel.set()

    def close(self) -> None:
        """`stop`, then end the thread once the current step ends."""
        self.stop()
        self._jobs.put(None)
        self._thread.join()

    def submit(self, input_ids: torch.Tensor, sampling: SamplingConfig, stream: bool) -> Job:
        """Queue a generation (called on the event loop).

        Raises:
            QueueFull: `max_waiting` jobs already wait behind the running one.
            ShuttingDown: the server is stopping.
        """
        if self._stopping:
            raise ShuttingDown()
        with self._lock:
            if self._pending > self.max_waiting:
                raise QueueFull(max(1, math.ceil(self._mean_job_s * (self._pending - self.max_waiting))))
            self._pending += 1
        job = Job(input_ids, sampling, stream, Relay(asyncio.get_running_loop(), self.stream_interval_s))
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._current = job
            started = time.perf_counter()
            try:
                report = self._generate(job)
                event = ("error", ShuttingDown()) if self._stopping and report.finish_reason == "cancelled" \
                    else ("done", report)
            except Exception as error:  # noqa: BLE001 - the request fails; the server keeps serving
                event = ("error", error)
            self._current = None
            with self._lock:  # before the last event: its client may send its next request at once
                self._pending -= 1
                self._mean_job_s += 0.2 * (time.perf_counter() - started - self._mean_job_s)
            job.send(*event)

    def _generate(self, job: Job) -> GenerationReport:
        if job.cancel.is_set() or self._stopping:  # its client left while it waited, or the server stops
            self.metrics.cancelled()
            return GenerationReport("", job.input_ids.shape[1], (), math.nan, math.nan, "cancelled")
        waited = time.perf_counter() - job.submitted
        if job.stream:
            report = stream_generate(self.model, job.input_ids, job.sampling, lambda text: job.send("text", text),
                                     job.cancel, lambda entry: job.send("logprob", entry))
        else:
            report = stream_generate(self.model, job.input_ids, job.sampling, lambda text: None, job.cancel)
        job.events.flush()  # the last text goes out now, not after the statistics below
        self.metrics.generated(report, waited, self.model.stats())  # stats here: the device is ours
        return report
