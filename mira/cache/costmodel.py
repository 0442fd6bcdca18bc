"""Which of a layer's missed experts the CPU computes and which cross PCIe to the GPU (policy).

Plain numbers in, expert ids out; the figures come from a start-up calibration
(`mira.runtime.calibrate`). A missed expert costs the CPU `cpu(tokens)` (it reads its blob in host
memory) or the GPU side `max(pcie(bytes), gpu(tokens))` (its kernel reads the blob over PCIe,
zero-copy, while it computes). The two sides run at once, so a layer's misses take the longer
of the two sums; `split` chooses the CPU set that makes that smallest.

Decode, with one token per miss, makes every miss cost the same on each side and the split a
count. Many tokens per expert (prefill) make the CPU's cost grow with the tokens while the PCIe
copy does not, so those experts stay on the GPU. Where a decode split of whole experts leaves one
side idle, one miss may be cut between the two (`Cuts`): the GPU computes its first intermediate
units, the CPU the rest.

`cpu_pays` decides whether a CPU share is worth running layers inline at all (the CPU needs each
layer's misses before its kernel), before decoding; `CpuPace` and `DevicePace` keep each side's costs
at the pace decoding measures, and `share_keeps` judges the share again at those paces once decoding
has measured them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

SWAP_MAX = 16  # misses up to which `split` tries moves and swaps after its prefix (O(n^2) each round)
INLINE_LAYER_S = 1e-3  # what a CPU share must save per decode layer to pay for running layers inline
# (a host sync and eager launches per layer, no CUDA graph): on the H200 inline mira decoded the
# Qwen3-30B-A3B shape at 8.43 tokens/s where lagged mira did 65.8, 2.2 ms more per layer
# (benchmarks/results/bench-qwen3-30b-a3b-lagged.json); Mixtral-8x7B's 3 ms misses hide most of it
KEEP_LAYER_S = 0.77e-3  # what a share priced at its learnt paces (`paced_saving`) must save per decode
# layer to stay on: set between the savings judged where the share lost against GPU-only mira on the
# H200 and those where it gained (docs/design.md, "Missed experts on the CPU", gives the runs)
SLOWEST_PCIE_BYTES_PER_S = 1e9  # below any GPU link in use (PCIe 3.0 x4 carries about 3.9 GB/s)


@dataclass(frozen=True)
class LinearCost:
    """Seconds for one expert as `fixed_s + per_token_s * tokens` (a least-squares fit)."""

    fixed_s: float
    per_token_s: float

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    @classmethod
    def fit(cls, tokens: Sequence[int], seconds: Sequence[float]) -> LinearCost:
        """The least-squares line through (tokens, seconds), its slope clamped at zero; a single token
        count gives a flat line."""
        n = len(tokens)
        if n == 0 or n != len(seconds):
            raise ValueError(f"fitting needs as many times as token counts, not {len(seconds)} and {n}")
        mean_t, mean_s = sum(tokens) / n, sum(seconds) / n
        spread = sum((t - mean_t) ** 2 for t in tokens)
        slope = sum((t - mean_t) * (s - mean_s) for t, s in zip(tokens, seconds)) / spread if spread else 0.0
        slope = max(slope, 0.0)
        return cls(fixed_s=max(mean_s - slope * mean_t, 0.0), per_token_s=slope)


@dataclass(frozen=True)
class HybridCosts:
    """The calibrated costs of one store's experts on one machine.

    Attributes:
        blob_bytes: the blob size the CPU figures were measured at.
        cpu: one expert on the CPU worker, by tokens.
        cpu_call_s: once per layer call with a CPU share: rows to the host, the worker's wake-up,
            the partial sum back to the device.
        pcie_bytes_per_s: host-to-device bandwidth; None without a GPU (nothing crosses PCIe).
        pcie_latency_s: fixed cost of one copy.
        gpu: one expert's kernel on the GPU from device memory, by tokens.
    """

    blob_bytes: int
    cpu: LinearCost
    cpu_call_s: float
    pcie_bytes_per_s: float | None
    pcie_latency_s: float = 0.0
    gpu: LinearCost = LinearCost(0.0, 0.0)

    def cpu_s(self, tokens: int, blob_bytes: int | None = None) -> float:
        """One expert on the CPU; a blob of another size scales the time by its bytes (decode on the
        CPU streams the weights once)."""
        scale = 1.0 if blob_bytes is None else blob_bytes / self.blob_bytes
        return self.cpu(tokens) * scale

    def pcie_s(self, tokens: int, blob_bytes: int | None = None) -> float:
        """One expert served by the GPU from host memory: its copy and its kernel overlap."""
        if not self.pcie_bytes_per_s:
            return math.inf
        nbytes = self.blob_bytes if blob_bytes is None else blob_bytes
        return max(self.pcie_latency_s + nbytes / self.pcie_bytes_per_s, self.gpu(tokens))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HybridCosts:
        return cls(blob_bytes=int(data["blob_bytes"]), cpu=LinearCost(**data["cpu"]),
                   cpu_call_s=float(data["cpu_call_s"]), pcie_bytes_per_s=data["pcie_bytes_per_s"],
                   pcie_latency_s=float(data["pcie_latency_s"]), gpu=LinearCost(**data["gpu"]))


class Pace(ABC):
    """How much slower (or faster) one side of the split runs in decoding than calibrated: a running
    geometric mean of measured over calibrated seconds, which scales that side's costs in later
    splits (`CpuPace`, `DevicePace`).

    Beside a busy host thread and PCIe traffic each side runs more slowly than any calibration in
    isolation shows, and by how much depends on the budget, the machine's load and the kind of
    job: the runtime keeps a pace for the CPU's jobs of whole experts, one for its jobs with a cut
    expert, and one for the device's side (mira.runtime.hybrid). A pace learnt only from the jobs
    it prices could price them out for good, so each decode layer with misses that gave a side no
    job of the kind a pace prices pulls that pace back towards the calibration: such jobs are then
    tried again.

    Args:
        learn: the weight of each decode job's ratio (0.05: about the last 20 jobs).
        forget: the weight with which each such passed-over layer pulls towards 1.
    """

    def __init__(self, learn: float = 0.05, forget: float = 0.01) -> None:
        for name, weight in (("learn", learn), ("forget", forget)):
            if not 0 <= weight <= 1:
                raise ValueError(f"{name} is a weight in [0, 1], not {weight}")
        self.learn, self.forget = learn, forget
        self._log = 0.0

    @classmethod
    def at(cls, scale: float) -> Pace:
        """A pace that stands at `scale` (to price with the paces a run ended with)."""
        if scale <= 0:
            raise ValueError(f"a pace is a positive ratio, not {scale}")
        pace = cls()
        pace._log = math.log(scale)
        return pace

    @property
    def scale(self) -> float:
        return math.exp(self._log)

    def observe(self, measured_s: float, calibrated_s: float) -> None:
        """One decode job: its side took `measured_s` where the calibration said `calibrated_s`."""
        if measured_s > 0 and calibrated_s > 0:
            self._log += self.learn * (math.log(measured_s / calibrated_s) - self._log)

    def passed_over(self) -> None:
        """A decode layer had misses and gave no job of the kind this pace prices."""
        self._log -= self.forget * self._log

    @abstractmethod
    def costs(self, calibrated: HybridCosts) -> HybridCosts:
        """The calibrated costs with this pace's side scaled."""


class CpuPace(Pace):
    """The CPU's pace: scales its cost per expert and per call."""

    def costs(self, calibrated: HybridCosts) -> HybridCosts:
        scale, cpu = self.scale, calibrated.cpu
        return replace(calibrated, cpu=LinearCost(cpu.fixed_s * scale, cpu.per_token_s * scale),
                       cpu_call_s=calibrated.cpu_call_s * scale)


class DevicePace(Pace):
    """The device's pace: scales its misses' copies (latency and bandwidth) and its kernels alike,
    and so every device-side time `split` predicts."""

    def costs(self, calibrated: HybridCosts) -> HybridCosts:
        scale, gpu = self.scale, calibrated.gpu
        bandwidth = None if calibrated.pcie_bytes_per_s is None else calibrated.pcie_bytes_per_s / scale
        return replace(calibrated, pcie_bytes_per_s=bandwidth, pcie_latency_s=calibrated.pcie_latency_s * scale,
                       gpu=LinearCost(gpu.fixed_s * scale, gpu.per_token_s * scale))


@dataclass(frozen=True)
class Cuts:
    """How one missed expert may be cut between the two sides: into `parts` equal shares of its
    intermediate units, the GPU computing the first ones and the CPU the rest. The GPU reads its
    shares' bytes. The CPU reads its shares of the gate/up rows, and of the down matrix (`down` of
    the blob) its columns at `column_cost` times their bytes, or the whole matrix where that costs
    less (mira.kernels.cpu_experts.CpuExpertFFN.reads_columns)."""

    parts: int
    down: float
    column_cost: float

    def __post_init__(self) -> None:
        if self.parts < 2 or not 0 <= self.down < 1 or not self.column_cost >= 1:
            raise ValueError(f"a cut needs at least 2 parts, a down share in [0, 1) and a column cost of at "
                             f"least 1, not {self.parts}, {self.down} and {self.column_cost}")

    def cpu_read(self, share: float) -> float:
        """The blob fraction the CPU's part of a cut with `share` of the units costs to read."""
        return (1 - self.down) * share + self.down * min(1.0, self.column_cost * share)


@dataclass(frozen=True)
class Split:
    """A layer's misses divided: expert ids for each side (ascending) and each side's predicted
    seconds; `cut` (expert, parts): that expert is cut, the CPU computing its last `parts` shares of
    `Cuts.parts` and the GPU the others (it is in neither list)."""

    cpu: list[int]
    pcie: list[int]
    cpu_s: float
    gpu_s: float
    cut: tuple[int, int] | None = None

    @property
    def predicted_s(self) -> float:
        """When the layer's misses are all served: the later of the two sides."""
        return max(self.cpu_s, self.gpu_s)


def split(misses: Sequence[tuple[int, int]], blob_bytes: int, costs: HybridCosts, gpu_busy_s: float = 0.0,
          cuts: Cuts | None = None, cut_costs: HybridCosts | None = None) -> Split:
    """Divide a layer's missed experts between the CPU and PCIe so that both finish together.

    Misses go to the CPU in order of their CPU cost over their PCIe cost, cheapest first; of the
    n + 1 prefixes of that order the one with the earliest finish is taken (on a tie, the fewer
    CPU experts). This is the optimum whenever every miss costs the same on the PCIe side (one
    blob size, and copies slower than the kernels: decode and prefill alike on PCIe). Otherwise
    it finishes at most one miss's cheaper cost after the optimum (the prefixes include both
    roundings of the best fractional split, which no whole split beats), and single moves and
    swaps between the sides then improve it while they can (for up to `SWAP_MAX` misses).

    Args:
        misses: (expert id, tokens routed to it) for each missed expert of the layer.
        blob_bytes: bytes of one expert blob.
        costs: the calibrated costs.
        gpu_busy_s: time the GPU side spends anyway (the hits' kernels), before the misses' share.
        cuts: how a miss may be cut between the sides (None: never); tried when every miss has the
            same tokens (decode) and the best whole split leaves one side idle (a layer's single
            miss, or a CPU too slow for a whole one), where a cut gains most.
        cut_costs: the costs that price a split with a cut, CPU and PCIe sides alike (None: `costs`).

    Returns:
        The split, with both sides' predicted times.
    """
    if len({tokens for _, tokens in misses}) == 1:
        alike = _split_alike(sorted(e for e, _ in misses), misses[0][1], blob_bytes, costs, gpu_busy_s)
        if cuts is None or (alike.cpu and alike.pcie):
            return alike
        return _cut_one(alike, misses[0][1], blob_bytes, cut_costs or costs, gpu_busy_s, cuts)
    priced = [(expert, costs.cpu_s(tokens, blob_bytes), costs.pcie_s(tokens, blob_bytes)) for expert, tokens in misses]
    priced.sort(key=lambda item: _ratio(item[1], item[2]))
    suffix = [0.0] * (len(priced) + 1)  # suffix[k]: PCIe seconds of the misses from position k on
    for k in range(len(priced) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + priced[k][2]
    best_k, best = 0, (0.0, gpu_busy_s + suffix[0])
    cpu = costs.cpu_call_s
    for k in range(1, len(priced) + 1):
        cpu += priced[k - 1][1]
        sides = (cpu, gpu_busy_s + suffix[k])
        if max(sides) < max(best):
            best_k, best = k, sides
    on_cpu, on_pcie = priced[:best_k], priced[best_k:]
    if len(priced) <= SWAP_MAX and len({p for _, _, p in priced}) > 1:
        on_cpu, on_pcie, best = _improve(on_cpu, on_pcie, best, costs.cpu_call_s)
    return Split(cpu=sorted(e for e, _, _ in on_cpu), pcie=sorted(e for e, _, _ in on_pcie), cpu_s=best[0],
                 gpu_s=best[1])


def cpu_pays(costs: HybridCosts, top_k: int, blob_bytes: int, miss_rate: float = 1.0,
             cuts: Cuts | None = None) -> bool:
    """Whether a CPU share pays where the misses could otherwise be left to the GPU without a host
    sync: in a decode layer whose `top_k` routed experts each miss with probability `miss_rate`
    (independently; the share of experts without a slot, as under uniform routing), the split (with
    a miss cut where `cuts` allows) must finish at least `INLINE_LAYER_S` before PCIe alone would,
    in expectation (`cpu_saving`). Cuts count: with admissions' copies priced on the device's side,
    what they save is saved (docs/design.md, "Missed experts on the CPU", says how that was found)."""
    return cpu_saving(costs, top_k, blob_bytes, miss_rate, cuts) >= INLINE_LAYER_S


def cpu_saving(costs: HybridCosts, top_k: int, blob_bytes: int, miss_rate: float = 1.0, cuts: Cuts | None = None,
               cut_costs: HybridCosts | None = None, alone: HybridCosts | None = None) -> float:
    """Expected seconds the split saves in a decode layer against PCIe alone, its `top_k` routed
    experts each missing with probability `miss_rate` (independently); `cut_costs` price a split
    with a cut (None: `costs`), `alone` the PCIe-only alternative (None: `costs`). A split that
    leaves the CPU nothing saves nothing: the layer runs as it would without a share."""
    if not 0 <= miss_rate <= 1:
        raise ValueError(f"miss_rate is a probability, not {miss_rate}")
    alone = alone or costs
    saved = 0.0
    for count in range(1, top_k + 1):
        misses = [(expert, 1) for expert in range(count)]
        pcie_alone = sum(alone.pcie_s(tokens, blob_bytes) for _, tokens in misses)
        chance = math.comb(top_k, count) * miss_rate ** count * (1 - miss_rate) ** (top_k - count)
        taken = split(misses, blob_bytes, costs, cuts=cuts, cut_costs=cut_costs)
        if taken.cpu or taken.cut is not None:
            saved += chance * (pcie_alone - taken.predicted_s)
    return saved


def paced_saving(calibrated: HybridCosts, cpu: Pace, cut: Pace, device: Pace | None, top_k: int, blob_bytes: int,
                 miss_rate: float, cuts: Cuts | None = None) -> float:
    """`cpu_saving` with the split priced at the paces decoding measured (the CPU's for whole experts,
    `cut`'s for a split with a cut, the device's for its side; None: its calibration) and PCIe alone at
    its calibration: without a share the GPU's copies have no CPU memory traffic beside them."""
    def at(pace: Pace) -> HybridCosts:
        costs = pace.costs(calibrated)
        return device.costs(costs) if device is not None else costs
    return cpu_saving(at(cpu), top_k, blob_bytes, miss_rate, cuts, cut_costs=at(cut), alone=calibrated)


def lane_layer_s(top_k: int, miss_rate: float, lanes: int, lane_expert_s: float, call_s: float, pcie_s: float,
                 quota: int) -> float:
    """The expected seconds of a decode layer's misses when the CPU lanes take up to `quota` of them
    inside a replayed step and the device reads the rest over PCIe (mira.runtime.graph_share), its
    `top_k` routed experts each missing with probability `miss_rate` (independently).

    With a quota q, m misses take max(ceil(min(q, m) / lanes) * lane_expert_s + call_s,
    (m - min(q, m)) * pcie_s): the lanes compute their experts at once while the device reads the
    rest, and every call pays the exchange's round trip `call_s`, misses or not. `lane_expert_s` is
    one expert on one lane while every lane computes.
    """
    if not 0 <= miss_rate <= 1:
        raise ValueError(f"miss_rate is a probability, not {miss_rate}")
    total = 0.0
    for misses in range(top_k + 1):
        chance = math.comb(top_k, misses) * miss_rate ** misses * (1 - miss_rate) ** (top_k - misses)
        taken = min(quota, misses)
        cpu_s = math.ceil(taken / lanes) * lane_expert_s + call_s if quota else 0.0
        total += chance * max(cpu_s, (misses - taken) * pcie_s)
    return total


def lane_quota(top_k: int, miss_rate: float, lanes: int, lane_expert_s: float, call_s: float, pcie_s: float) -> int:
    """How many of a decode layer's misses the CPU lanes take inside a replayed step: the quota of
    least expected layer time (`lane_layer_s`, the smaller quota where two tie); 0 where none beats
    PCIe alone."""
    return min(range(top_k + 1),
               key=lambda quota: (lane_layer_s(top_k, miss_rate, lanes, lane_expert_s, call_s, pcie_s, quota), quota))


def share_keeps(saving_s: float) -> bool:
    """Whether a CPU share whose `paced_saving` is `saving_s` per decode layer stays on (`KEEP_LAYER_S`)."""
    return saving_s >= KEEP_LAYER_S


def cpu_may_pay(top_k: int, blob_bytes: int) -> bool:
    """Whether `cpu_pays` could hold on any machine, before calibrating this one: a split saves at
    most PCIe alone's time for a layer's `top_k` misses, which even at SLOWEST_PCIE_BYTES_PER_S must
    reach INLINE_LAYER_S (small experts are then never worth the calibration's seconds)."""
    return top_k * blob_bytes / SLOWEST_PCIE_BYTES_PER_S >= INLINE_LAYER_S


def _split_alike(experts: list[int], tokens: int, blob_bytes: int, costs: HybridCosts, busy: float) -> Split:
    """`split` of misses that all cost the same (decode: one token each): only the CPU count k
    matters, and the best k is next to where the two sides' lines cross."""
    n, c, p, call = len(experts), costs.cpu_s(tokens, blob_bytes), costs.pcie_s(tokens, blob_bytes), costs.cpu_call_s

    def sides(k: int) -> tuple[float, float]:
        return (call + k * c if k else 0.0), busy + (n - k) * p

    if math.isinf(p):
        k = n
    elif math.isinf(c):
        k = 0
    else:
        cross = (busy + n * p - call) / (c + p)  # call + k c = busy + (n - k) p
        candidates = {0, n, min(n, max(0, math.floor(cross))), min(n, max(0, math.ceil(cross)))}
        k = min(sorted(candidates), key=lambda k: max(sides(k)))  # the fewer CPU experts on a tie
    cpu_s, gpu_s = sides(k)
    return Split(cpu=experts[:k], pcie=experts[k:], cpu_s=cpu_s, gpu_s=gpu_s)


def _cut_one(whole: Split, tokens: int, blob_bytes: int, costs: HybridCosts, busy: float, cuts: Cuts) -> Split:
    """`whole` (a split of n alike misses) or, where it finishes earlier, k whole misses on the CPU,
    one cut and the other n - k - 1 on PCIe. For each k the CPU's side grows and the GPU's does not
    as the CPU's share of the cut grows, so the best share is a whole part next to where they cross
    (found by bisection)."""
    experts = whole.cpu + whole.pcie
    n, c, p, call = len(experts), costs.cpu_s(tokens, blob_bytes), costs.pcie_s(tokens, blob_bytes), costs.cpu_call_s
    if not n or math.isinf(c) or math.isinf(p):
        return whole

    def sides(k: int, j: int) -> tuple[float, float]:
        share = j / cuts.parts  # of the cut's units, on the CPU
        cpu = call + k * c + costs.cpu_s(tokens, round(blob_bytes * cuts.cpu_read(share)))
        return cpu, busy + (n - k - 1) * p + costs.pcie_s(tokens, round(blob_bytes * (1 - share)))

    best, best_sides = None, (whole.cpu_s, whole.gpu_s)
    for k in range(n):
        low, high = 1, cuts.parts - 1  # the first share whose CPU side is not the earlier one, or high
        while low < high:
            middle = (low + high) // 2
            cpu, gpu = sides(k, middle)
            low, high = (low, middle) if cpu >= gpu else (middle + 1, high)
        for j in (low - 1, low) if low > 1 else (low,):
            candidate = sides(k, j)
            if max(candidate) < max(best_sides) * (1 - 1e-9):
                best, best_sides = (k, j), candidate
    if best is None:
        return whole
    k, j = best
    return Split(cpu=sorted(experts[:k]), pcie=sorted(experts[k + 1:]), cpu_s=best_sides[0], gpu_s=best_sides[1],
                 cut=(experts[k], j))


def _improve(on_cpu: list, on_pcie: list, sides: tuple[float, float], call_s: float) -> tuple[list, list, tuple]:
    """Move one miss across, or swap two, while that makes the later side finish earlier."""
    while True:
        cpu_s, gpu_s = sides
        options = [(i, None) for i in range(len(on_cpu))] + [(None, j) for j in range(len(on_pcie))]
        options += [(i, j) for i in range(len(on_cpu)) for j in range(len(on_pcie))]
        best = None
        for i, j in options:
            out_c, out_p = (on_cpu[i][1], on_cpu[i][2]) if i is not None else (0.0, 0.0)
            in_c, in_p = (on_pcie[j][1], on_pcie[j][2]) if j is not None else (0.0, 0.0)
            stays = len(on_cpu) - (i is not None) + (j is not None)
            new_cpu = (cpu_s - out_c + in_c) if stays else 0.0
            if stays and not on_cpu:
                new_cpu += call_s
            new = (new_cpu, gpu_s - in_p + out_p)
            if max(new) < max(best[2] if best else sides) * (1 - 1e-12):
                best = (i, j, new)
        if best is None:
            return on_cpu, on_pcie, sides
        i, j, sides = best
        leaving = [on_cpu.pop(i)] if i is not None else []
        if j is not None:
            on_cpu.append(on_pcie.pop(j))
        on_pcie.extend(leaving)


def _ratio(cpu_s: float, pcie_s: float) -> float:
    """CPU cost per unit of PCIe cost (the order misses go to the CPU in); an infinite PCIe cost first."""
    if math.isinf(pcie_s):
        return -math.inf if not math.isinf(cpu_s) else 0.0
    return cpu_s / pcie_s if pcie_s > 0 else math.inf
