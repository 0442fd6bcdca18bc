"""The CPU's share of each decode call's misses, chosen on the device, so the step still replays (DESIGN.md 2.8).

Lagged residency keeps a decode step free of host syncs, so it replays from a CUDA graph; the
inline CPU share (mira.runtime.hybrid) gives that up, which on small experts costs more than the
CPU saves. Here a layer's decode call chooses the CPU's experts with device operations only: among
the routed experts read from their host blobs (the address table holds the blob's address), the
first `quota` in expert order. Their entries become 0 in a copy of the table that the kernel reads
(it adds zero for them), and the call hands them to the CPU lanes through the mailbox
(mira.runtime.mailbox, mira.runtime.cpu_lanes), which compute them while the kernel computes the
rest; the lanes' sums are added into the layer's output. Each layer's quota comes from the cost
model (mira.cache.costmodel.lane_quota): at load from the budget's share of experts without a slot,
then again from the miss rate each layer's decode calls saw (`requote`); a layer with quota 0 takes
no part.

The policy still sees every routed token (the layer counts them first), so a token the CPU served
is a miss for its scores. Larger calls (prefill) stay on the device.

E experts in a layer, T tokens, K routed per token.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mira.cache.costmodel import HybridCosts, lane_layer_s, lane_quota
from mira.cache.tables import ExpertTables
from mira.errors import MiraError
from mira.kernels import DECODE_TOKENS
from mira.runtime.cpu_lanes import CpuLanes
from mira.runtime.hybrid import CpuExperts, worker_threads
from mira.runtime.mailbox import Mailbox
from mira.store.store import ExpertStore

CALIBRATION_REPEATS = 5  # timed exchanges per job size (their median is kept)
LANE_COUNTS = (1, 2)  # the lane counts load times, where there are the threads: one expert at a time on every
# thread, or two at once on half each (small experts keep fewer threads busy)
QUOTA_STEPS = 16  # decode steps between the quotas priced again at the miss rates they saw
ANSWER_S = 10.0  # how long load waits for the lanes to answer one exchange before giving up


@dataclass(frozen=True)
class LanePrices:
    """What a decode layer's split costs, in seconds: one expert on one lane while every lane
    computes, an exchange's round trip, one miss read by the device; for `top_k` routed experts a
    token and `lanes` lanes."""

    top_k: int
    lanes: int
    expert_s: float
    call_s: float
    pcie_s: float

    def quota(self, miss_rate: float) -> int:
        """The lanes' quota for a layer whose routed experts miss at `miss_rate`."""
        return lane_quota(self.top_k, miss_rate, self.lanes, self.expert_s, self.call_s, self.pcie_s)

    def layer_s(self, miss_rate: float) -> float:
        """The expected seconds of such a layer's misses at that quota."""
        return lane_layer_s(self.top_k, miss_rate, self.lanes, self.expert_s, self.call_s, self.pcie_s,
                            self.quota(miss_rate))


def fastest(prices: Sequence[LanePrices], miss_rate: float) -> LanePrices:
    """The lane count of least expected layer time at `miss_rate` (the fewer lanes where two tie)."""
    return min(prices, key=lambda each: (each.layer_s(miss_rate), each.lanes))


class GraphShare:
    """Chooses each decode call's CPU experts on the device and exchanges them with the lanes.

    The mailbox and the lanes are made by the first decode call, in its rows' dtypes (an eager call:
    a step is captured the second time it is seen).

    Args:
        tables: the cache's address tables.
        make_lanes: the CPU lanes serving a mailbox (closed when this object is collected).
        lanes: L, the lanes `make_lanes` deals the work to.
        quotas: per MoE layer, the most misses of a decode call the lanes compute.
        device: where the layers run.
        prices: what a split costs, by which `requote` prices quotas again; None: they stay.
        timed: the prices of every lane count load timed, `prices` among them (reported by `summary`).
    """

    def __init__(self, tables: ExpertTables, make_lanes: Callable[[Mailbox], CpuLanes], lanes: int,
                 quotas: Sequence[int], device: torch.device, prices: LanePrices | None = None,
                 timed: Sequence[LanePrices] = ()) -> None:
        if len(quotas) != len(tables.rows) or min(quotas) < 0:
            raise ValueError(f"a quota of at least 0 for each of the {len(tables.rows)} MoE layers, not {list(quotas)}")
        E = tables.tables.shape[1]
        self.lanes: CpuLanes | None = None
        self.quotas = list(quotas)
        self.prices = prices
        self.timed = list(timed)
        self.requotes = 0  # times `requote` changed a quota
        self._window = np.zeros((len(self.quotas), 2), dtype=np.int64)  # per layer: decode tokens routed, missed
        self._steps = 0  # decode steps in the window
        self._make_lanes = make_lanes
        self._lane_count = lanes
        self._device = torch.device(device)
        self._tables = tables
        self._blob_addresses = tables.blob_addresses.view(-1, E)  # [L, E]
        self._routed = torch.zeros(E, dtype=torch.bool, device=device)
        self._miss = torch.zeros(E, dtype=torch.bool, device=device)
        self._rank = torch.zeros(E, dtype=torch.int64, device=device)
        self._chosen = torch.zeros(E, dtype=torch.bool, device=device)  # the CPU's experts of the call
        self._kernel_table = torch.zeros(E, dtype=torch.int64, device=device)  # the kernel's copy of the table
        self._zero = torch.zeros((), dtype=torch.int64, device=device)
        self._none = torch.full((), -1, dtype=torch.int64, device=device)
        self._chosen_routes: torch.Tensor | None = None  # [DECODE_TOKENS * K], made by the first call
        self._ids: torch.Tensor | None = None  # [DECODE_TOKENS, K], made by the first call too

    def takes(self, layer_position: int, hidden: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
        """Whether this call goes through the lanes: a decode call of a layer with a quota whose
        rows fit the mailbox (made now by the first)."""
        if hidden.shape[0] > DECODE_TOKENS or not self.quotas[layer_position]:
            return False
        if self.lanes is None:
            box = Mailbox(self._lane_count, hidden.shape[1], top_k_weights.shape[1], hidden.dtype,
                          top_k_weights.dtype, self._device)
            self.lanes = self._make_lanes(box)
            weakref.finalize(self, self.lanes.close)
        return self.lanes.mailbox.fits(hidden, top_k_weights)

    def post(self, layer_position: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
        """Before the kernel: choose the CPU's experts and hand them to the lanes; returns the
        kernel's address table [E], theirs at 0 (no host sync)."""
        self._choose(layer_position, top_k_index)
        T, K = top_k_index.shape
        if self._ids is None or self._ids.shape[1] != K:
            self._ids = torch.empty(DECODE_TOKENS, K, dtype=torch.int64, device=top_k_index.device)
            self._chosen_routes = torch.empty(DECODE_TOKENS * K, dtype=torch.bool, device=top_k_index.device)
        routes = torch.index_select(self._chosen, 0, top_k_index.reshape(-1), out=self._chosen_routes[:T * K])
        ids = torch.where(routes.view(T, K), top_k_index, self._none, out=self._ids[:T])  # [T, K]
        self.lanes.mailbox.post(layer_position, hidden, ids, top_k_weights)
        return torch.where(self._chosen, self._zero, self._tables.tables[layer_position], out=self._kernel_table)

    def rows(self, layer_position: int) -> list[torch.Tensor | None]:
        """After `post`, on the CPU: the blobs the reference FFN reads, the CPU's experts None."""
        chosen = self._chosen.tolist()
        return [None if taken else blob for blob, taken in zip(self._tables.rows[layer_position], chosen)]

    def collect(self, out: torch.Tensor) -> torch.Tensor:
        """After the kernel: out [T, H] += the lanes' sums (on CUDA enqueued, without a host sync)."""
        return self.lanes.mailbox.collect(out, self.lanes.check)

    def decode_settled(self, misses: np.ndarray) -> bool:
        """A decode step settled, its tokens routed and missed per layer, int [L, 2]
        (mira.cache.telemetry.Telemetry.layer_misses): every QUOTA_STEPS steps the quotas are priced
        again at the window's miss rates (`requote`); whether one changed."""
        self._window += misses
        self._steps += 1
        if self._steps < QUOTA_STEPS:
            return False
        rates = [missed / routed if routed else 0.0 for routed, missed in self._window.tolist()]
        self._window[:] = 0
        self._steps = 0
        return self.requote(rates)

    def requote(self, miss_rates: Sequence[float]) -> bool:
        """Each layer's quota priced at the miss rate its decode calls saw; whether any changed
        (captured steps then hold the old ones: the caller captures them again)."""
        if self.prices is None:
            return False
        quotas = [self.prices.quota(rate) for rate in miss_rates]
        changed, self.quotas = quotas != self.quotas, quotas
        self.requotes += changed
        return changed

    def check(self) -> None:
        """Raise a lane's error, if one failed since the last check (its experts added zero)."""
        if self.lanes is not None:
            self.lanes.check()

    def summary(self) -> dict:
        lanes = self.lanes
        served = {"experts": sum(lanes.served), "tokens": sum(lanes.tokens),
                  "busy_ms": round(sum(lanes.busy_s) * 1e3, 3), "threads_per_lane": lanes.threads} \
            if lanes is not None else {"experts": 0, "tokens": 0}
        prices = {"prices_us": _in_us(self.prices)} if self.prices is not None else {}
        if len(self.timed) > 1:
            prices["timed_lanes_us"] = {each.lanes: _in_us(each) for each in self.timed}
        return {"mode": "graph", "lanes": self._lane_count, "quota": self.quotas, "requotes": self.requotes,
                **prices, **served}

    def _choose(self, layer_position: int, top_k_index: torch.Tensor) -> None:
        """`_chosen` [E]: the first `quota` routed experts, in expert order, that are read from their host blobs."""
        routed = self._routed.zero_().index_fill_(0, top_k_index.reshape(-1), True)
        miss = torch.eq(self._tables.tables[layer_position], self._blob_addresses[layer_position], out=self._miss)
        miss.logical_and_(routed)
        rank = torch.cumsum(miss, 0, out=self._rank)
        torch.le(rank, self.quotas[layer_position], out=self._chosen).logical_and_(miss)


def _in_us(prices: LanePrices) -> dict[str, float]:
    return {name: round(getattr(prices, name) * 1e6, 1) for name in ("expert_s", "call_s", "pcie_s")}


def make_graph_share(store: ExpertStore, tables: ExpertTables, act, gate, costs: HybridCosts | None,
                     top_k: int | None, miss_rate: float, dtype: torch.dtype, device: torch.device,
                     threads: int | None = None, lanes: int | None = None) -> GraphShare:
    """The CPU lanes' share for --cpu-experts graph over `store`, its lanes computing with the
    family's `act` or `gate` on `threads` (None: mira.runtime.hybrid.worker_threads) dealt to `lanes`.
    Each layer's quota is priced by the lanes timed now and the PCIe calibration `costs` (LanePrices),
    first at `miss_rate`; with `lanes` None each of LANE_COUNTS that the threads allow is timed, and
    the one of least expected layer time kept (`fastest`). Where nothing crosses PCIe (the CPU) or the
    routed experts per token (`top_k`) are unknown, the lanes take every miss, on `lanes` (None: the
    most of LANE_COUNTS the threads allow).

    Raises:
        MiraError: more lanes than threads.
    """
    threads = worker_threads(threads)
    if lanes is not None and lanes > threads:
        raise MiraError(f"--cpu-lanes {lanes} needs at least as many CPU threads, not {threads}; pass --cpu-threads "
                        f"{lanes} or more, or fewer lanes")
    counts = [lanes] if lanes is not None else [count for count in LANE_COUNTS if count <= threads]
    blobs = [[store.blob(layer, expert) for expert in range(store.num_experts)] for layer in range(store.num_layers)]

    def make_lanes(box: Mailbox) -> CpuLanes:
        return CpuLanes(lambda: CpuExperts(store.layout, act, gate), blobs, box, threads)

    if costs is None or not costs.pcie_bytes_per_s or top_k is None:
        return GraphShare(tables, make_lanes, counts[-1], [top_k or store.num_experts] * store.num_layers, device)

    def priced(count: int) -> LanePrices:
        timed = make_lanes(Mailbox(count, store.layout.hidden, top_k, dtype, torch.float32, device))
        try:
            expert_s, call_s = time_lanes(timed, blobs[0], device)
        finally:
            timed.close()
        return LanePrices(top_k, count, expert_s, call_s, costs.pcie_s(1, store.blob_bytes))

    timed = [priced(count) for count in counts]
    prices = fastest(timed, miss_rate)
    return GraphShare(tables, make_lanes, prices.lanes, [prices.quota(miss_rate)] * store.num_layers, device, prices,
                      timed)


def time_lanes(lanes: CpuLanes, blobs: Sequence[torch.Tensor], device: torch.device) -> tuple[float, float]:
    """(one expert on one lane while every lane computes, an exchange's round trip) in seconds, from
    exchanges made as replayed decode steps make them: none, then n and 2n experts (n = L where the
    layer has enough), one token each, on distinct experts of `blobs` (one layer's). On CUDA each
    job size's exchange is captured once and replayed, the host waiting in a synchronize: an eager
    exchange's driver calls (ctypes) each let the GIL go and take it back from the polling lanes,
    which no replayed step does.

    Raises:
        MiraError: on CUDA, the lanes did not answer an exchange within `ANSWER_S` (the stream is
            released first).
    """
    box = lanes.mailbox
    L, (_, H), K = box.lanes, box.rows.shape, box.ids.shape[1]
    n = max(1, min(L, len(blobs) // 2, DECODE_TOKENS // 2))
    rows = torch.randn(2 * n, H).to(device, box.rows.dtype)
    weights = torch.ones(2 * n, K, dtype=box.weights.dtype, device=device)
    out = torch.zeros(2 * n, H, device=device)
    ids = torch.full((2 * n, K), -1, dtype=torch.int64, device=device)  # the CPU's experts: one a token, in column 0
    medians, first = [], 0
    for count in (0, n, 2 * n):
        tokens = max(count, 1)
        exchange = _exchange(box, lanes, rows[:tokens], ids[:tokens], weights[:tokens], out[:tokens])
        seconds = []
        for _ in range(CALIBRATION_REPEATS + 1):  # the first is a warm-up
            ids[:count, 0] = torch.arange(first, first + count, device=device) % len(blobs)
            first += count
            _settled(device)
            with _watched(box):
                begin = time.perf_counter()
                exchange()
                _settled(device)
                seconds.append(time.perf_counter() - begin)
            lanes.check()
        medians.append(statistics.median(seconds[1:]))
    empty_s, one_s, two_s = medians
    extra = math.ceil(2 * n / L) - math.ceil(n / L)  # experts more on the busiest lane
    return max(0.0, (two_s - one_s) / extra if extra else one_s - empty_s), empty_s


def _exchange(box: Mailbox, lanes: CpuLanes, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              out: torch.Tensor) -> Callable[[], None]:
    """One decode call's exchange with the lanes, on these buffers: on CUDA a graph of it, captured
    now and replayed by each call; on the CPU made eagerly by each call."""
    def made() -> None:
        box.post(0, rows, ids, weights)
        box.collect(out, lanes.check)

    if box.device.type != "cuda":
        return made
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        made()
    return graph.replay


def _settled(device: torch.device) -> None:
    """Wait, the GIL let go, until the device is through what was enqueued (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _watched(box: Mailbox) -> Iterator[None]:
    """Around an exchange and the wait for it, on CUDA: if the lanes have not answered within
    `ANSWER_S`, their DONE flags are raised from the host, so the held stream goes on, and then
    MiraError raised. The watchdog's thread starts before the body, so its start is not timed."""
    if box.device.type != "cuda":
        yield
        return
    expired = threading.Event()

    def release() -> None:
        expired.set()
        box.release()

    watchdog = threading.Timer(ANSWER_S, release)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
    if expired.is_set():
        raise MiraError(f"the CPU lanes did not answer a decode call's exchange within {ANSWER_S:g} s (stream "
                        "memory operations on pinned memory); pass --cpu-experts split or off")
