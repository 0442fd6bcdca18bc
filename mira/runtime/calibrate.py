"""Start-up calibration of the hybrid cost model (mira.cache.costmodel): this machine's CPU time
per expert by token count, and with a GPU its PCIe bandwidth and kernel time, in a few seconds.

The CPU is timed on the worker's own thread (its thread count) over distinct blobs, so that no
expert's weights are still in the CPU's caches from the call before, while the calling thread does
what the host thread does beside the worker in decoding: small torch operations between stretches
of Python. The two share the GIL, and the worker takes it back after each operation
(benchmarks/cpu_gil.py measures what that costs). With a GPU, copies run over
PCIe meanwhile, as they do when both sides serve misses: host memory bandwidth is shared, and
the CPU computes more slowly then. Every CPU figure is a mean, not a median: the cost model adds
times up, and the rare slow call (one of the worker's threads preempted holds up its whole
parallel region) costs decoding as much as it costs the mean. Results are kept per machine beside
the kernel tuning (`mira.kernels.tuning`): `<device>-hybrid.json`, one entry per CPU, thread count,
shape and scheme; an entry of an older FORMAT is measured again.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from mira.cache.costmodel import HybridCosts, LinearCost
from mira.errors import MiraError
from mira.kernels import make_moe_ffn
from mira.kernels.tuning import TUNING_DIR, device_key
from mira.runtime.cpu_worker import CpuExpertWorker, HostRows
from mira.store.files import write_json_atomic

TOKENS = (1, 2, 4, 8)  # token counts the CPU and GPU lines are fitted over
CPU_BUDGET_S = 1.0  # CPU timing, all token counts together
ROUND_TRIPS = 30  # of an empty job, for the per-call cost
KERNEL_CALLS = 20  # launches timed together per GPU figure
PCIE_BYTES_PER_S_GUESS = 50e9  # sizes the copy load before the bandwidth is measured
HOST_OPERATIONS, HOST_ELEMENTS, HOST_PYTHON = 6, 8, 200  # the host's loop beside the timed CPU (keep_host_busy)
MEASUREMENTS = 3  # loads at most that measure a machine again whose saved calibration gave auto's share nothing
FORMAT = 3  # of a stored entry: 3 timed without the caller's idle OpenMP team, 2 beside it, 1 (unmarked) medians


def calibrate(worker: CpuExpertWorker, blobs: Sequence[torch.Tensor], device: torch.device | str, *,
              tokens: Sequence[int] = TOKENS, cpu_budget_s: float = CPU_BUDGET_S) -> HybridCosts:
    """Measure the costs of the worker's blob layout on this machine.

    Args:
        worker: the CPU expert worker (its executor's layout and activation, its thread count).
        blobs: distinct host-store blobs of that layout (pinned with a GPU), together larger
            than the CPU's caches (a layer's experts, say).
        device: where the GPU side runs; "cpu" measures the CPU only.
        tokens: token counts the lines are fitted over.
        cpu_budget_s: about how long the CPU is timed.

    Returns:
        The costs; without a GPU `pcie_bytes_per_s` is None.

    Raises:
        MiraError: no blobs, or a GPU with blobs that are not pinned.
    """
    device = torch.device(device)
    if not blobs:
        raise MiraError("calibration needs the blobs of some experts; pass a layer's blobs from the store")
    layout = worker.ffn.layout
    cuda = device.type == "cuda"
    if cuda and not all(blob.is_pinned() for blob in blobs):
        raise MiraError("calibration on a GPU needs pinned blobs; open the store with pin=True")
    bandwidth, latency, gpu = None, 0.0, LinearCost(0.0, 0.0)
    load = None
    if cuda:
        bandwidth, latency = _pcie(blobs, device)
        gpu = _gpu_kernel(worker, blobs[0], device, tokens)
        load = _copy_load(blobs, device, seconds=cpu_budget_s, bytes_per_s=bandwidth)
    per_count = max(cpu_budget_s / len(tokens), 1e-3)
    seconds = [keep_host_busy(worker.call(_time_cpu, worker.ffn, blobs, t, per_count)) for t in tokens]
    if load is not None:
        load.synchronize()
    cpu_call = _round_trip(worker, blobs, device)
    return HybridCosts(blob_bytes=layout.nbytes, cpu=LinearCost.fit(list(tokens), seconds), cpu_call_s=cpu_call,
                       pcie_bytes_per_s=bandwidth, pcie_latency_s=latency, gpu=gpu)


def keep_host_busy(future: Future):
    """Until `future` is done, run on this thread what the host does while the worker computes (small
    torch operations, each of which lets the GIL go, between short stretches of Python); its result."""
    a, b = torch.zeros(HOST_ELEMENTS), torch.ones(HOST_ELEMENTS)
    while not future.done():
        for _ in range(HOST_OPERATIONS):
            a.add_(b)
        sum(range(HOST_PYTHON))  # Python holding the GIL for a few microseconds
    return future.result()


def costs_path(device: torch.device | str, directory: Path = TUNING_DIR) -> Path:
    """The machine's calibration file: named for the GPU, or "cpu" without one."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return directory / f"{device_key(name)}-hybrid.json"


def entry_key(worker: CpuExpertWorker) -> str:
    """What the CPU figures depend on besides the GPU: the processor, the worker's threads, the
    expert shape and the scheme."""
    layout = worker.ffn.layout
    return f"{cpu_name()} | {worker.threads} threads | {layout.hidden}x{layout.intermediate} | {layout.scheme}"


def save_costs(path: Path, key: str, costs: HybridCosts, written_by: str, measurements: int = 1) -> None:
    """Merge one entry into the calibration file (atomically: readers see the old file or the new);
    `measurements`: how many calibrations it was chosen from."""
    data = _read(path) if path.exists() else {"entries": {}}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    data["entries"][key] = {"costs": costs.to_json(), "format": FORMAT, "date": date, "written_by": written_by,
                            "measurements": measurements}
    write_json_atomic(path, data)


def saved_measurements(path: Path, key: str) -> int:
    """How many calibrations the stored entry was chosen from (1 for an entry that does not say)."""
    return _read(path)["entries"][key].get("measurements", 1)


def load_costs(path: Path, key: str) -> HybridCosts | None:
    """The stored entry, or None when there is none or it is of an older FORMAT (to be measured again).

    Raises:
        MiraError: the file is not calibration data.
    """
    if not path.exists():
        return None
    entry = _read(path)["entries"].get(key)
    if entry is None or entry.get("format") != FORMAT:
        return None
    try:
        return HybridCosts.from_json(entry["costs"])
    except (KeyError, TypeError, ValueError) as error:
        raise MiraError(f"{path} holds a malformed entry {key!r} ({error}); delete the file to calibrate again") from None


def cpu_name() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data.get("entries"), dict):
            raise ValueError("no entries")
        return data
    except (OSError, ValueError, AttributeError) as error:
        raise MiraError(f"{path} is not hybrid calibration data ({error}); delete it to calibrate again") from None


def _time_cpu(ffn, blobs: Sequence[torch.Tensor], tokens: int, budget_s: float) -> float:
    """Mean seconds of one expert at `tokens` tokens, cycling through `blobs` (runs on the worker)."""
    layout = ffn.layout
    x = torch.randn(tokens, layout.hidden).to(torch.bfloat16)
    views = [layout.views(blob) for blob in blobs]
    ffn.expert(x, views[0])  # first-call work (kernel selection) outside the timing
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 10 * len(views)):
        view = views[len(times) % len(views)]
        begin = time.perf_counter()
        ffn.expert(x, view)
        times.append(time.perf_counter() - begin)
    return statistics.fmean(times)


def _round_trip(worker: CpuExpertWorker, blobs: Sequence[torch.Tensor], device: torch.device) -> float:
    """Mean seconds of a job with no experts: rows to the host, the worker's wake-up, the sum back."""
    layout = worker.ffn.layout
    rows = HostRows(1, layout.hidden, 1, torch.bfloat16, device)
    hidden = torch.randn(1, layout.hidden, device=device).to(torch.bfloat16)
    index = torch.zeros(1, 1, dtype=torch.int64, device=device)
    weights = torch.ones(1, 1, device=device)
    out = torch.zeros_like(hidden)
    times = []
    for _ in range(ROUND_TRIPS):
        _sync(device)
        begin = time.perf_counter()
        job = rows.stage(hidden, index, weights, 0, [], blobs)
        rows.add_into(out, worker.submit(job).result())
        _sync(device)
        times.append(time.perf_counter() - begin)
    return statistics.fmean(times)


def _pcie(blobs: Sequence[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """(bytes per second, seconds of latency) of pinned host-to-device copies of distinct blobs."""
    nbytes = blobs[0].numel()
    slot = torch.empty(nbytes, dtype=torch.uint8, device=device)
    batch = min(len(blobs), 8)
    single, together = [], []
    for repeat in range(5):
        single.append(_gpu_seconds(lambda: slot.copy_(blobs[repeat % len(blobs)], non_blocking=True), device))
        together.append(_gpu_seconds(lambda: [slot.copy_(blob, non_blocking=True) for blob in blobs[:batch]], device))
    bandwidth = batch * nbytes / statistics.median(together)
    latency = max(0.0, statistics.median(single) - nbytes / bandwidth)
    return bandwidth, latency


def _gpu_kernel(worker: CpuExpertWorker, blob: torch.Tensor, device: torch.device,
                tokens: Sequence[int]) -> LinearCost:
    """One expert's kernel from device memory, by tokens (the kernel the layer would launch, through
    its address table where it takes one), launched `KERNEL_CALLS` times back to back."""
    layout = worker.ffn.layout
    ffn = make_moe_ffn(device, layout, worker.ffn.act)
    resident = blob.to(device)
    table = torch.tensor([resident.data_ptr()], dtype=torch.int64, device=device)  # [E = 1]
    seconds = []
    for t in tokens:
        hidden = torch.randn(t, layout.hidden, device=device).to(torch.bfloat16)
        index = torch.zeros(t, 1, dtype=torch.int64, device=device)
        weights = torch.ones(t, 1, device=device)
        if hasattr(ffn, "forward_bases"):
            def launch():
                return ffn.forward_bases(hidden, index, weights, table)
        else:
            def launch():
                return ffn(hidden, index, weights, [resident])
        launch()  # compiles outside the timing
        calls = [_gpu_seconds(lambda: [launch() for _ in range(KERNEL_CALLS)], device) for _ in range(3)]
        seconds.append(statistics.median(calls) / KERNEL_CALLS)
    return LinearCost.fit(list(tokens), seconds)


def _copy_load(blobs: Sequence[torch.Tensor], device: torch.device, seconds: float,
               bytes_per_s: float | None) -> torch.cuda.Stream:
    """Enqueue about `seconds` of host-to-device copies on a stream of their own; returns the stream."""
    stream = torch.cuda.Stream(device=device)
    nbytes = blobs[0].numel()
    slot = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copies = math.ceil(seconds * (bytes_per_s or PCIE_BYTES_PER_S_GUESS) / nbytes)
    with torch.cuda.stream(stream):
        for i in range(copies):
            slot.copy_(blobs[i % len(blobs)], non_blocking=True)
    return stream


def _gpu_seconds(work, device: torch.device) -> float:
    """Seconds of the device work `work()` enqueues on the current stream, by CUDA events."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    work()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
