"""The CPU's share of each MoE layer's misses, wired into decoding (DESIGN.md 2.8).

Inline, a layer knows its misses before its kernel (`ExpertCache.settle_layer`). A decode call's
rows go to the host first (`HybridExperts.copy_rows`, queued ahead of the settle's waits for the
copies of experts it admits). `HybridExperts.start` then chooses the misses the CPU computes
(every one, or the cost model's split), copies a larger call's rows to the host, makes the
worker's job and hides those experts from the layer's address table (address 0: the kernel adds
zero for them, its weights unread). The layer's kernel then computes the rest; `finish` restores
the table and adds the CPU's partial sum into the layer's output.

Who starts first. The worker takes the GIL between its operations, so once it has a job the
host's own steps (the table updates, the kernel's launch) run several times more slowly. On CUDA,
where the device's side is predicted the longer, `start` therefore keeps the job and `finish`
hands it over, once the kernel is launched; otherwise (and on a CPU-only run, whose "kernel"
computes in place) `start` hands it over at once.

A one-token call may also cut one miss between the two sides (`Split.cut`): the kernel computes
its first intermediate units, read over PCIe, while the CPU computes the rest (the table's limit
for that expert says where the kernel stops), so a layer with a single miss need not leave one
side idle.

On CUDA the host does not wait for the CPU's share: `finish` enqueues a hold on the stream
(mira.runtime.host_signal) that the worker releases when its sum is written, then the copy and
the add. The host goes on enqueueing the next layer's attention while the CPU computes, and
waits only at that layer's own routing read-back. The next `start` collects the finished job
(its telemetry, or the worker's error). On a CPU-only run the "device side" is the reference FFN
on the CPU, and `finish` waits for the worker. A layer whose kernel fails between the two calls
`abandon` instead: the table whole again, and no post left over to let a later hold through early.

With a `CpuPace`, splits and predictions price the CPU's side at the pace decoding measures
(mira.cache.costmodel): each decode job's measured CPU side against its calibrated one. Jobs with a
cut keep a pace of their own: their part carries the job's fixed costs on fewer bytes, and priced
with whole experts' pace they would drive it up until the CPU got cuts alone, from which that pace
then learnt nothing. On CUDA a `DevicePace` does the same for the device's side (its misses' reads
over PCIe beside the CPU's traffic, and its kernels), timed by events around it.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from mira.cache.costmodel import CpuPace, Cuts, DevicePace, HybridCosts, Split, paced_saving, split
from mira.cache.tables import ExpertTables
from mira.cache.telemetry import HybridTelemetry
from mira.kernels import DECODE_TOKENS
from mira.kernels.cpu_experts import CpuExpertFFN
from mira.kernels.reference import expert_ffn
from mira.kernels.tuning import TUNING_DIR
from mira.runtime.calibrate import MEASUREMENTS, calibrate, costs_path, entry_key, load_costs, save_costs, \
    saved_measurements
from mira.runtime.cpu_worker import CpuExpertWorker, CpuJob, HostRows
from mira.runtime.host_signal import HostSignal
from mira.store.cache import cache_dir
from mira.store.layout import ExpertLayout
from mira.store.store import ExpertStore


class CpuExperts(CpuExpertFFN):
    """The CPU executor of the store's experts. Activations in float32 (CPU-only runs) are computed
    in float32 on the dequantized weights, as the reference FFN computes the other experts of the
    layer, so greedy output does not depend on which side computed an expert; others go through the
    executor's bf16 INT8 products."""

    def expert(self, x: torch.Tensor, views: dict[str, torch.Tensor], first: int = 0) -> torch.Tensor:
        if x.dtype == torch.float32:
            units = (first, self.layout.intermediate) if first else None
            return expert_ffn(x, views, self.layout, self.act, self.gate, units)
        return super().expert(x, views, first)


def worker_threads(requested: int | None) -> int:
    """The CPU worker's threads: `requested`, else the caller's torch threads less one (at least 1)."""
    return requested if requested is not None else max(1, torch.get_num_threads() - 1)


def expert_cuts(layout: ExpertLayout, granule: int | None, column_cost: float) -> Cuts | None:
    """How a miss of this layout may be cut, given the device kernel's cut granule (None: it cannot
    cut): whole granules of intermediate units, the CPU's columns of the down matrix at its
    executor's `column_cost`."""
    if granule is None or layout.intermediate // granule < 2:
        return None
    return Cuts(layout.intermediate // granule, layout.sections["w2"].nbytes / layout.nbytes, column_cost)


def calibration_dir() -> Path:
    """Where calibrations made at load are saved: beside the converted stores, under $MIRA_CACHE."""
    return cache_dir().parent / "calibration"


def machine_costs(worker: CpuExpertWorker, store: ExpertStore, device: torch.device, progress: bool = False,
                  pays: Callable[[HybridCosts], bool] | None = None) -> HybridCosts:
    """This machine's calibrated costs for the store's experts: shipped beside the kernel tuning,
    else saved by an earlier load, else measured now (a few seconds, on one layer's blobs; said on
    stderr with `progress`) and saved.

    A saved calibration under which `pays` says the CPU's share does not pay is measured again, at
    up to MEASUREMENTS loads, and the one whose CPU was the faster is kept: a calibration taken
    while the host was busy would otherwise keep auto's share off on this machine for good, where
    one priced too cheaply is corrected by the paces decoding measures (`CpuPace`)."""
    key = entry_key(worker)
    shipped = load_costs(costs_path(device, TUNING_DIR), key)
    if shipped is not None:
        return shipped
    path = costs_path(device, calibration_dir())
    saved = load_costs(path, key)
    measurements = saved_measurements(path, key) if saved is not None else 0
    if saved is not None and (pays is None or pays(saved) or measurements >= MEASUREMENTS):
        return saved
    if progress:
        when = "again, as the last calibration gave it no share" if saved is not None else \
            "once per machine and expert shape"
        print(f"mira: timing this machine's CPU and PCIe for the experts it may compute on the CPU ({when}; "
              "--cpu-experts off skips it)", file=sys.stderr, flush=True)
    blobs = [store.blob(0, expert) for expert in range(store.num_experts)]
    measured = calibrate(worker, blobs, device)
    costs = measured if saved is None else min(saved, measured, key=lambda costs: costs.cpu_s(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_costs(path, key, costs, written_by="mira.load (--cpu-experts)", measurements=measurements + 1)
    return costs


@dataclass
class CpuShare:
    """The CPU's part of one layer call, in flight between `start` and `finish`."""

    layer_position: int
    experts: list[int]  # computed whole, hidden from the kernel
    cut: tuple[int, int] | None  # (expert, first unit the CPU computes), the kernel's limit for it
    tokens: int
    job: CpuJob
    future: Future | None  # of the partial sum [T, H]; None until the worker has the job (`finish` hands it over)
    begin: float
    predicted: tuple[float, float, float] | None  # seconds: the layer's misses served, the CPU's side, the device's
    calibrated_cpu_s: float  # the CPU's side as calibrated, before its pace (0.0 without a pace)
    calibrated_device_s: float  # the device's side so, where it served a miss (else 0.0: nothing learnt)


class HybridExperts:
    """Hands each layer's chosen misses to the CPU worker and adds its partial sums back.

    Args:
        worker: the CPU worker (closed when this object is collected).
        store: the expert store (the host blobs the CPU reads).
        tables: the cache's address tables (entries hidden from the kernel meanwhile).
        costs: the calibrated costs (None: no predictions, which `split_misses` needs).
        split_misses: split each layer's misses by the cost model; else the CPU computes every miss.
        device: where the layers run.
        pace: follows the CPU's measured pace in decoding for jobs of whole experts, and a copy of
            it (`cut_pace`) for jobs with a cut; None: the calibrated costs as they are.
        device_pace: with `pace`, a `DevicePace` of its weights (`device_pace`) follows the device's
            side too; False: the device's side at its calibration (`device_pace` None).
        cut_granule: the device kernel's cut granule (`TritonMoEFFN.cut_granule`); with it and a
            PCIe figure in `costs` (a GPU), splits of one-token calls may cut a miss between the
            sides; None: never.

    Attributes:
        telemetry: per layer, the CPU's calls, experts, tokens and times (mira.cache.telemetry).
    """

    def __init__(self, worker: CpuExpertWorker, store: ExpertStore, tables: ExpertTables, costs: HybridCosts | None,
                 split_misses: bool, device: torch.device, pace: CpuPace | None = None,
                 cut_granule: int | None = None, device_pace: bool = True):
        if split_misses and costs is None:
            raise ValueError("splitting misses needs calibrated costs")
        self.cuts = expert_cuts(store.layout, cut_granule, worker.ffn.column_cost) \
            if split_misses and costs.pcie_bytes_per_s else None
        self._granule = cut_granule
        self._intermediate = store.layout.intermediate
        self.worker = worker
        self.costs = costs
        self.pace = pace
        self.cut_pace = CpuPace(pace.learn, pace.forget) if pace is not None else None
        self.device_pace = DevicePace(pace.learn, pace.forget) if pace is not None and device_pace else None
        self.split_misses = split_misses
        self.telemetry = HybridTelemetry(store.num_layers)
        self._tables = tables
        self._blob_bytes = store.blob_bytes
        self._blobs = [[store.blob(layer, e) for e in range(store.num_experts)] for layer in range(store.num_layers)]
        self._device = torch.device(device)
        self._rows: HostRows | None = None  # made by the first call, grown by a larger one
        self._signal = HostSignal() if self._device.type == "cuda" else None
        # on CUDA, around the device's side of the call in flight: its table updates and its kernel
        self._device_side = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self._signal is not None else None
        self._pending: CpuShare | None = None  # the job `finish` left to the stream, collected by `start`
        self._copied = False  # `copy_rows` copied this call's rows already
        self._top_k = 0  # experts routed per token, from the first call
        self._decode_lookups = 0  # routed experts of decode calls, and those of them that missed
        self._decode_misses = 0
        weakref.finalize(self, worker.close)

    @property
    def mode(self) -> str:
        return "split" if self.split_misses else "all"

    def may_cut(self, tokens: int) -> bool:
        """Whether a call of `tokens` tokens may cut a miss (its kernel then takes the table's limits)."""
        return self.cuts is not None and tokens == 1

    def choose(self, on_device: list[tuple[int, int]], from_host: list[tuple[int, int]],
               may_cut: bool = False, copied: Sequence[tuple[int, int]] = ()) -> Split | None:
        """The layer's misses divided: the cost model's split (a miss cut too, where `may_cut` and
        the kernel can), or every miss to the CPU; None without costs for the latter (no prediction).
        The device side starts with the kernels of `on_device` and the copies of `copied` (its
        experts admitted now), which cross PCIe before the misses' reads."""
        costs = self._paced(self.pace)
        if costs is None:  # "all" without a calibration (a split always has costs)
            return None
        busy = (sum(costs.gpu(tokens) for _, tokens in on_device)
                + sum(costs.pcie_s(tokens, self._blob_bytes) - costs.gpu(tokens) for _, tokens in copied))
        if self.split_misses:
            cut_costs = self._paced(self.cut_pace) if may_cut else None  # priced only where a cut may be made
            return split(from_host, self._blob_bytes, costs, gpu_busy_s=busy, cuts=self.cuts if may_cut else None,
                         cut_costs=cut_costs)
        cpu_s = costs.cpu_call_s + sum(costs.cpu_s(tokens, self._blob_bytes) for _, tokens in from_host)
        return Split(cpu=[e for e, _ in from_host], pcie=[], cpu_s=cpu_s, gpu_s=busy)

    def copy_rows(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Before a decode call's settle: its rows copied to the host now, so that on CUDA they go
        ahead of the settle's waits for the experts it admits, and the CPU's job, made by `start`,
        need not wait for those copies (a larger call's rows are copied by `start`, if it makes a job).
        Only the worker is waited for here; `start` records the last job after the settle's read-back,
        by which its device side has ended (reading that here would be a second host sync)."""
        if self._pending is not None:  # one job per set of host rows (their event is recorded again)
            self._pending.future.exception()  # waits, raising nothing: `start`'s collect raises the error
        self._copied = hidden.shape[0] <= DECODE_TOKENS
        if self._copied:
            self._host_rows(hidden, top_k_weights).copy_in(hidden, top_k_index, top_k_weights)

    def start(self, layer_position: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              on_device: list[tuple[int, int]], from_host: list[tuple[int, int]],
              copied: Sequence[tuple[int, int]] = ()) -> CpuShare | None:
        """Before the layer's kernel: the CPU's share of the misses, handed to the worker now or by
        `finish` (see "Who starts first" above), and those experts hidden from the table (the
        arguments after `top_k_weights`: mira.cache.cache.Settled). None when the CPU gets none."""
        rows_copied, self._copied = self._copied, False
        self.collect()  # the last job recorded (a larger call's rows are copied below, over its host rows)
        if hidden.shape[0] <= DECODE_TOKENS:
            self._top_k = top_k_index.shape[1]
            self._decode_lookups += len(on_device) + len(from_host)
            self._decode_misses += len(from_host) + len(copied)  # an admitted miss is a miss too
        if not from_host:
            return None
        plan = self.choose(on_device, from_host, may_cut=self.may_cut(hidden.shape[0]), copied=copied)
        experts = plan.cpu if plan is not None else [e for e, _ in from_host]
        cut = None
        if plan is not None and plan.cut is not None:
            expert, parts = plan.cut
            cut = (expert, (self.cuts.parts - parts) * self._granule)
        pace = self.cut_pace if cut is not None else self.pace
        device_served = plan is not None and (bool(plan.pcie) or cut is not None)  # a miss read by the kernel
        if self.pace is not None and hidden.shape[0] <= DECODE_TOKENS:
            self._pass_over(pace if experts or cut is not None else None, device_served)
        if not experts and cut is None:
            return None
        rows = self._host_rows(hidden, top_k_weights)
        begin = time.perf_counter()
        done = self._signal.post if self._signal is not None else None
        computed = sorted(experts + [cut[0]]) if cut is not None else experts
        if not rows_copied:
            rows.copy_in(hidden, top_k_index, top_k_weights)
        job = rows.job(hidden.shape[0], layer_position, computed, self._blobs[layer_position], done, cut)
        device_first = self._signal is not None and plan is not None and plan.gpu_s > plan.cpu_s
        future = None if device_first else self.worker.submit(job)  # see "Who starts first" above
        if self._device_side is not None:
            self._device_side[0].record()
        self._tables.hide(layer_position, experts)
        if cut is not None:
            self._tables.cut(layer_position, *cut)
        chosen = set(computed)
        tokens = sum(t for e, t in from_host if e in chosen)
        calibrated_cpu = plan.cpu_s / pace.scale if plan is not None and pace is not None else 0.0
        device_pace = self.device_pace
        calibrated_device = plan.gpu_s / device_pace.scale if device_served and device_pace is not None else 0.0
        return CpuShare(layer_position, experts, cut, tokens, job, future, begin,
                        (plan.predicted_s, plan.cpu_s, plan.gpu_s) if plan is not None else None, calibrated_cpu,
                        calibrated_device)

    def finish(self, share: CpuShare, out: torch.Tensor) -> torch.Tensor:
        """After the layer's kernel has been launched on `out` [T, H]: hand the worker its job if
        `start` kept it, restore the table and add the CPU's partial sum into `out` on the device's
        current stream; on CUDA without waiting for it (the stream holds until the worker is
        through), on the CPU after it."""
        if share.future is None:
            share.future = self.worker.submit(share.job)
        self._restore(share)
        if self._signal is None:
            out = self._rows.add_into(out, share.future.result())
            self._record(share)
            return out
        self._device_side[1].record()
        self._signal.hold()
        self._pending = share
        return self._rows.add_into(out, share.job.out)

    def abandon(self, share: CpuShare) -> None:
        """The layer failed between `start` and `finish`: restore its table and, if the worker has
        the job, wait until it is through (its host rows are then free) and, on CUDA, take back the
        post that no hold will match. The worker's own error, if any, gives way to the layer's."""
        self._restore(share)
        if share.future is None:  # never handed over: no post will come
            return
        share.future.exception()  # waits, raising nothing
        if self._signal is not None:
            self._signal.take()

    def collect(self) -> None:
        """Wait for the job `finish` left to the stream, if any (by the next layer's read-back it is
        done), record its telemetry, and raise the worker's error if it failed."""
        share, self._pending = self._pending, None
        if share is not None:
            share.future.result()
            self._record(share)

    def restart_telemetry(self) -> None:
        """Telemetry from now on only (the job in flight recorded first); the paces keep what they learnt."""
        self.collect()
        self.telemetry = HybridTelemetry(len(self.telemetry.calls))

    def paced_saving(self) -> float | None:
        """Seconds the split is expected to save per decode layer against PCIe alone, at the paces
        learnt so far and the miss rate of the decode calls seen so far (mira.cache.costmodel.
        paced_saving); None before any decode lookup, or without calibrated costs and a pace."""
        if self.costs is None or self.pace is None or not self._decode_lookups:
            return None
        return paced_saving(self.costs, self.pace, self.cut_pace, self.device_pace, self._top_k, self._blob_bytes,
                            self._decode_misses / self._decode_lookups, self.cuts)

    def paces(self) -> dict:
        """The paces learnt so far, by name (none without a pace)."""
        pace = {"cpu_pace": round(self.pace.scale, 4), "cpu_cut_pace": round(self.cut_pace.scale, 4)} \
            if self.pace is not None else {}
        if self.device_pace is not None:
            pace["device_pace"] = round(self.device_pace.scale, 4)
        return pace

    def summary(self) -> dict:
        self.collect()
        return {"mode": self.mode, "threads": self.worker.threads, **self.paces(), **self.telemetry.summary()}

    def _pass_over(self, given: CpuPace | None, device_served: bool) -> None:
        """A decode layer with misses gave the CPU a job priced by `given` (None: no job), and the
        device a miss or not: the paces of the jobs not given are pulled towards the calibration."""
        for pace in (self.pace, self.cut_pace):
            if pace is not given:
                pace.passed_over()
        if not device_served and self.device_pace is not None:
            self.device_pace.passed_over()

    def _paced(self, pace: CpuPace | None) -> HybridCosts | None:
        """The calibrated costs, the CPU's side at `pace` and the device's at its own."""
        costs = self.costs
        for each in (pace, self.device_pace):
            if each is not None and costs is not None:
                costs = each.costs(costs)
        return costs

    def _restore(self, share: CpuShare) -> None:
        """The layer's table whole again: hidden experts back to their blobs, a cut expert uncut."""
        self._tables.restore(share.layer_position, share.experts)
        if share.cut is not None:
            self._tables.uncut(share.layer_position, share.cut[0])

    def _record(self, share: CpuShare) -> None:
        job = share.job
        measured = job.finished - share.begin
        cut_share = 1 - share.cut[1] / self._intermediate if share.cut is not None else 0.0
        device_s = self._device_seconds()
        paced = self.pace is not None and job.hidden.shape[0] <= DECODE_TOKENS  # prefill extrapolates the line
        self.telemetry.record(share.layer_position, len(share.experts), share.tokens, measured, job.compute_s,
                              share.predicted, cut_share, device_s, share.calibrated_cpu_s if paced else 0.0)
        if paced:
            (self.cut_pace if share.cut is not None else self.pace).observe(measured, share.calibrated_cpu_s)
            if device_s is not None and self.device_pace is not None:
                self.device_pace.observe(device_s, share.calibrated_device_s)

    def _device_seconds(self) -> float | None:
        """The device's side of the last call, between its events; None on a CPU-only run."""
        if self._device_side is None:
            return None
        begin, end = self._device_side
        if not end.query():  # done already after the next layer's read-back; not yet in `summary`
            end.synchronize()
        return begin.elapsed_time(end) / 1e3

    def _host_rows(self, hidden: torch.Tensor, top_k_weights: torch.Tensor) -> HostRows:
        rows = self._rows
        tokens, size = hidden.shape
        top_k = top_k_weights.shape[1]
        if rows is None or rows.hidden.shape[0] < tokens or rows.hidden.dtype != hidden.dtype \
                or rows.top_k_index.shape[1] != top_k or rows.top_k_weights.dtype != top_k_weights.dtype:
            self._rows = rows = HostRows(max(tokens, DECODE_TOKENS), size, top_k, hidden.dtype, self._device,
                                         top_k_weights.dtype)
        return rows
