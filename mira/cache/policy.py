"""Which experts occupy the expert slots: policy on plain integers, no tensors (paper IV-C, IV-D; DESIGN.md 2.6).

An expert is identified by a uid, `layer_position * num_experts + expert` (layer_position counts MoE
layers only). The mechanism (`mira.cache.cache.ExpertCache`, or the simulator) replays accesses in
a fixed order: token step by token step, MoE layer by MoE layer, and within one (step, layer) group
each distinct routed expert once, in ascending id. For every access the policy answers where the
expert is served from and what changes in residency; the mechanism carries that out (copies, slot
hand-overs). A policy never evicts an expert accessed in the current group, so every expert of a
layer call stays resident until the layer has computed (capacity >= experts per layer is required
for every one of them to be resident; with fewer slots the rest are served from the host).
A policy may start with residents (the static placement): the mechanism loads `resident()` before
the first access. Only `access` and `stage` change which uids are resident; `end_step` may move
residents between the HOT and STAGE tiers (a slot hand-over, no copy) but never admits or evicts.

Policies: `MiraPolicy` (the paper's HOT+STAGE cache with the adaptive rebalancer), and the
baselines `LRU`, `LFU`, `Static` (Fiddler-style placement from a profile) and `OnDemand`.
Belady's offline optimum is in `mira.cache.belady`.
"""

from __future__ import annotations

import array
import enum
import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mira.cache.config import CacheConfig


class Tier(enum.IntEnum):
    """Where a routed expert's tokens were served from."""

    HOT = 0
    STAGE = 1
    MISS = 2  # read from the host store (the paper's "CPU-served")


@dataclass(frozen=True)
class Access:
    """The answer to one access.

    tier: where the expert was when it was asked for.
    admit: on a miss, whether the expert is admitted into a slot (read-through) rather than served
        from the host store alone.
    evict: the uid whose slot the admitted expert takes, or None when a free slot is used.
    """

    tier: Tier
    admit: bool = False
    evict: int | None = None


SERVED = {tier: Access(tier) for tier in Tier}  # the answers without admission, made once: the settle path is hot


class Policy(ABC):
    """A cache replacement policy over `capacity` expert slots.

    hot_slots / stage_slots: how the capacity is split between the two tiers; single-tier policies
    keep every resident in HOT.
    admits_misses: whether misses are admitted into slots (LRU and LFU admit every one, mira
        some) rather than never (static, on-demand). Under lagged residency each admission is a
        second PCIe crossing of a miss the kernel has already read, so the engine keeps such
        policies inline unless asked otherwise.
    """

    name: str = "policy"
    admits_misses: bool = True

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.hot_slots = capacity
        self.stage_slots = 0
        self._group: set[int] = set()

    def begin_group(self) -> None:
        """A new (token step, layer) group starts: experts of the previous group may be evicted again."""
        self._group.clear()

    def access(self, uid: int, tokens: int) -> Access:
        """Expert `uid` is routed `tokens` tokens in the current group.

        Args:
            uid: the expert, `layer_position * num_experts + expert`.
            tokens: how many tokens of the group are routed to it (>= 1).

        Returns:
            Where it is served from and, on a miss, whether and in place of whom it is admitted.
        """
        self._group.add(uid)
        return self._access(uid, tokens)

    @abstractmethod
    def _access(self, uid: int, tokens: int) -> Access: ...

    @abstractmethod
    def resident(self) -> set[int]:
        """The uids that hold a slot now."""

    def tier_of(self, uid: int) -> Tier:
        """The tier `uid` sits in now: HOT or STAGE when it holds a slot, else MISS."""
        return Tier.HOT if uid in self.resident() else Tier.MISS

    def end_step(self, tokens: int) -> None:
        """A token step of `tokens` tokens has finished (interval-driven policies act here)."""

    def _evictable(self, uid: int) -> bool:
        return uid not in self._group


class LRU(Policy):
    """Least recently used: every miss is admitted, the least recently used resident goes."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()  # least recent first

    def _access(self, uid: int, tokens: int) -> Access:
        if uid in self._order:
            self._order.move_to_end(uid)
            return SERVED[Tier.HOT]
        if self.capacity == 0:
            return SERVED[Tier.MISS]
        victim = None
        if len(self._order) >= self.capacity:
            victim = next((u for u in self._order if self._evictable(u)), None)
            if victim is None:
                return SERVED[Tier.MISS]  # every slot holds an expert of this group
            del self._order[victim]
        self._order[uid] = None
        return Access(Tier.MISS, admit=True, evict=victim)

    def resident(self) -> set[int]:
        return set(self._order)

    def tier_of(self, uid: int) -> Tier:
        return Tier.HOT if uid in self._order else Tier.MISS


class LFU(Policy):
    """Least frequently used: every miss is admitted, the resident with the fewest accesses so far goes.

    Access counts cover the whole history, residents or not (an expert keeps its count when
    evicted); ties go to the least recently used. Residents sit in a min-heap keyed
    (count, last access); entries made stale by a later access are skipped when they surface.
    """

    name = "lfu"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._count: dict[int, int] = {}  # uid -> accesses so far
        self._last: dict[int, int] = {}  # resident uid -> clock of its last access
        self._heap: list[tuple[int, int, int]] = []  # (count, last, uid)
        self._clock = 0

    def _access(self, uid: int, tokens: int) -> Access:
        self._clock += 1
        self._count[uid] = self._count.get(uid, 0) + 1
        if uid in self._last:
            self._touch(uid)
            return SERVED[Tier.HOT]
        if self.capacity == 0:
            return SERVED[Tier.MISS]
        victim = None
        if len(self._last) >= self.capacity:
            victim = self._pop_victim()
            if victim is None:
                return SERVED[Tier.MISS]  # every slot holds an expert of this group
        self._touch(uid)
        return Access(Tier.MISS, admit=True, evict=victim)

    def _touch(self, uid: int) -> None:
        self._last[uid] = self._clock
        heapq.heappush(self._heap, (self._count[uid], self._clock, uid))
        if len(self._heap) > 4 * len(self._last) + 64:  # drop stale entries now and then
            self._heap = [(self._count[u], last, u) for u, last in self._last.items()]
            heapq.heapify(self._heap)

    def _pop_victim(self) -> int | None:
        """Remove and return the least frequent evictable resident, or None if there is none."""
        kept: list[tuple[int, int, int]] = []
        victim = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, last, uid = entry
            if self._last.get(uid) != last:
                continue  # stale
            if self._evictable(uid):
                victim = uid
                del self._last[uid]
                break
            kept.append(entry)
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return victim

    def resident(self) -> set[int]:
        return set(self._last)

    def tier_of(self, uid: int) -> Tier:
        return Tier.HOT if uid in self._last else Tier.MISS


@dataclass(frozen=True)
class Popularity:
    """Routed tokens per expert (uid order) in recorded routing over `tokens` token steps: what the
    static policy places and the mira policy's prior."""

    counts: tuple[int, ...]
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or any(count < 0 for count in self.counts):
            raise ValueError("a popularity profile counts tokens: no negative figures")

    @classmethod
    def of_routing(cls, counts: Sequence[int], top_k: int, num_layers: int) -> Popularity:
        """From routed tokens per uid alone: every token routes `top_k` experts in each of the
        `num_layers` layers."""
        counts = tuple(int(count) for count in counts)
        return cls(counts, sum(counts) // (top_k * num_layers))

    @classmethod
    def of_trace(cls, trace) -> Popularity:
        """From a routing trace (mira.store.trace.RoutingTrace): its routed tokens per uid."""
        return cls(tuple(int(count) for count in trace.expert_counts()), trace.num_tokens)

    def rate(self, uid: int) -> float:
        """Routed tokens per token step of `uid` in the profile."""
        return self.counts[uid] / self.tokens if self.tokens and uid < len(self.counts) else 0.0

    def ranked(self) -> list[int]:
        """The uids routed at least once, most routed first (ties to the lower uid)."""
        return sorted((uid for uid, count in enumerate(self.counts) if count > 0), key=lambda uid: -self.counts[uid])


class Static(Policy):
    """Fiddler-style static placement: the `capacity` experts with the most routed tokens in a profile.

    The placement is loaded before the first access and never changes; everything else is served
    from the host store.

    Args:
        capacity: expert slots.
        profile: routed tokens per uid in the profile; ties go to the lower uid, and uids with no
            tokens are never placed.
    """

    name = "static"
    admits_misses = False

    def __init__(self, capacity: int, profile: Popularity):
        super().__init__(capacity)
        self._placed = frozenset(profile.ranked()[:capacity])

    def _access(self, uid: int, tokens: int) -> Access:
        return SERVED[Tier.HOT if uid in self._placed else Tier.MISS]

    def resident(self) -> set[int]:
        return set(self._placed)

    def tier_of(self, uid: int) -> Tier:
        return Tier.HOT if uid in self._placed else Tier.MISS


class OnDemand(Policy):
    """No cache at all: every access is a miss served from the host store (the capacity is unused)."""

    name = "on-demand"
    admits_misses = False

    def _access(self, uid: int, tokens: int) -> Access:
        return SERVED[Tier.MISS]

    def resident(self) -> set[int]:
        return set()

    def tier_of(self, uid: int) -> Tier:
        return Tier.MISS


class Heat:
    """Routed tokens of uids 0..size-1 with exponential decay: each token's weight is multiplied by
    `decay` per step.

    Kept in units that grow by 1/decay per step (tracked as a logarithm), so a step costs O(1)
    rather than one multiply per expert; the units are brought back to 1 before they grow past
    about 1e100, which also makes long prefill steps safe. One buffer, read one uid at a time from
    Python (the settle path, per routed expert) or many at once through a numpy view of it.
    """

    _RESCALE_AT = 230.0  # natural log of the unit, about 1e100

    def __init__(self, decay: float, size: int):
        if not 0 < decay <= 1:
            raise ValueError(f"heat decay must be in (0, 1], got {decay}")
        self._growth = -math.log(decay)  # log of the unit's growth per step
        self._log_unit = 0.0  # log of the weight of a token routed now
        self._unit, self._inverse = 1.0, 1.0  # exp(log_unit), exp(-log_unit)
        self._scaled = array.array("d", bytes(8 * size))  # Python-speed scalar access
        self._view = np.frombuffer(self._scaled, dtype=np.float64)  # the same memory, for vector reads

    def add(self, uid: int, tokens: int) -> None:
        self._scaled[uid] += tokens * self._unit

    def advance(self, steps: int) -> None:
        """`steps` token steps have passed."""
        self._log_unit += steps * self._growth
        if self._log_unit > self._RESCALE_AT:
            self._view *= math.exp(-self._log_unit)  # 0.0 when everything has decayed away
            self._log_unit = 0.0
        self._unit, self._inverse = math.exp(self._log_unit), math.exp(-self._log_unit)

    def __getitem__(self, uid: int) -> float:
        return self._scaled[uid] * self._inverse

    def of(self, uids: np.ndarray) -> np.ndarray:
        """The heat of each uid of `uids`."""
        return self._view[uids] * self._inverse


def split_slots(capacity: int, total_experts: int, config: CacheConfig) -> tuple[int, int]:
    """HOT and STAGE slot counts for `capacity` slots (paper IV-C: small- and large-VRAM modes).

    Small-VRAM mode, when less than `config.small_vram_fraction` of all experts fit, gives STAGE
    `stage_fraction_small` of the slots, large-VRAM mode `stage_fraction_large`. With two slots
    or more, STAGE gets at least one (a probation area must exist) and HOT at least one.

    Args:
        capacity: expert slots.
        total_experts: experts over all MoE layers.
        config: the cache configuration.

    Returns:
        (hot_slots, stage_slots), summing to `capacity`.
    """
    if capacity < 2:
        return capacity, 0
    small = capacity < config.small_vram_fraction * total_experts
    fraction = config.stage_fraction_small if small else config.stage_fraction_large
    stage = min(max(round(capacity * fraction), 1), capacity - 1)
    return capacity - stage, stage


class MiraPolicy(Policy):
    """The paper's HOT+STAGE cache (IV-C, IV-D), admitting and evicting by the PCIe bytes an expert saves.

    Every expert has an expected reuse: routed tokens per token step, estimated from its heat (its
    routed tokens, decayed by `config.heat_decay` per step) blended with a prior, the rate the
    profile gave it (`prior`, the calibration prompts' routing or `--profile`), worth
    `config.prior_weight` steps of evidence. With no evidence beyond the prior the cache holds the
    profile's most routed experts (HOT first, then STAGE), exactly the static placement.

    A miss is read from the host either way; admitting it moves `admission_cost` more blobs over
    PCIe: one, since under lagged residency (the default on CUDA) the kernel has already read the
    miss zero-copy and the admission copies it again. (Inline, where the copy is the read, the
    same rule keeps the policy's decisions those of lagged residency, a step earlier.) Over the
    horizon the heat estimates (1 / (1 - heat_decay) steps) a resident saves one blob per use, so a
    miss takes a free slot when its expected uses exceed the admission's cost plus
    `config.admission_margin` (its heat, just raised by the access that missed, overstates its
    reuse), and the slot of the least valuable STAGE entry outside the current group when its
    expected uses exceed the victim's by more than that; otherwise it is served from the host
    without admission. STAGE is the probation area:
    after every `config.rebalance_interval` tokens (`end_step`), at most `config.max_swaps` STAGE
    entries with a higher expected reuse than HOT's least valuable residents swap tiers with them
    (a hand-over of slots: nothing is copied or evicted).

    Args:
        capacity: expert slots.
        total_experts: experts over all MoE layers (selects small- or large-VRAM mode).
        config: the cache configuration.
        stage_slots: overrides the STAGE size from `split_slots`.
        prior: routed tokens per uid in a profile, and over how many tokens (None: no prior).
        admission_cost: blobs an admission moves over PCIe beyond the miss's own read (hand-worked
            cases set 0).
    """

    name = "mira"

    def __init__(self, capacity: int, total_experts: int, config: CacheConfig, stage_slots: int | None = None,
                 prior: Popularity | None = None, admission_cost: float = 1.0):
        super().__init__(capacity)
        if stage_slots is None:
            self.hot_slots, self.stage_slots = split_slots(capacity, total_experts, config)
        elif 0 <= stage_slots <= capacity:
            self.hot_slots, self.stage_slots = capacity - stage_slots, stage_slots
        else:
            raise ValueError(f"stage_slots must be between 0 and the capacity {capacity}, got {stage_slots}")
        if admission_cost < 0:
            raise ValueError(f"admission_cost must be >= 0, got {admission_cost}")
        self.config = config
        self.admission_cost = admission_cost
        self._threshold = admission_cost + config.admission_margin  # blobs an admission must save beyond
        decay = config.heat_decay
        self.horizon = 1 / (1 - decay) if decay < 1 else math.inf  # steps the heat looks back (and ahead)
        self._heat = Heat(decay, total_experts)
        self._evidence = 1.0  # steps the heat covers, the current one included: sum of decay ** age
        self._weight = config.prior_weight if prior is not None else 0.0
        rates = [prior.rate(uid) for uid in range(total_experts)] if prior is not None else [0.0] * total_experts
        self._prior_term = self._weight * np.array(rates)  # [total_experts]
        self._prior_terms = self._prior_term.tolist()  # the same, for reads one uid at a time
        # Victims, exactly and without ranking STAGE per miss: until the step ends only the experts
        # accessed in it change value. The others keep their order of the step's start (_victims,
        # least valuable first); the accessed ones sit in a heap by their latest value.
        self._touched: dict[int, float] = {}  # accessed in this step -> expected reuse now
        self._touched_heap: list[tuple[float, int]] = []  # (expected reuse, uid), stale entries skipped
        self._victims: list[int] | None = None
        self._next_victim = 0  # entries before it in _victims are gone or touched
        self._tokens = 0  # since the last rebalancing pass
        placed = prior.ranked()[:capacity] if prior is not None else []
        self._hot = set(placed[: self.hot_slots])
        self._stage = set(placed[self.hot_slots:])

    def expected_rate(self, uid: int) -> float:
        """Routed tokens per token step `uid` is expected to get: its heat blended with the prior."""
        return (self._heat[uid] + self._prior_terms[uid]) / (self._evidence + self._weight)

    def _rates(self, uids: np.ndarray) -> np.ndarray:
        return (self._heat.of(uids) + self._prior_term[uids]) / (self._evidence + self._weight)

    def _access(self, uid: int, tokens: int) -> Access:
        self._heat.add(uid, tokens)
        rate = self._touch(uid)
        tier = self.tier_of(uid)
        if tier is not Tier.MISS:
            return SERVED[tier]
        return self._admit(uid, rate)

    def _admit(self, uid: int, rate: float) -> Access:
        """Where a missed expert (expected reuse `rate`) goes: a free HOT or STAGE slot, a less
        valuable STAGE entry's slot, or nowhere."""
        gain = self._saved(rate)
        if gain <= self._threshold:  # no slot, free or a victim's (worth >= 0), is worth its moves
            return SERVED[Tier.MISS]
        if len(self._hot) < self.hot_slots or len(self._stage) < self.stage_slots:
            (self._hot if len(self._hot) < self.hot_slots else self._stage).add(uid)
            return Access(Tier.MISS, admit=True)
        victim = self._stage_victim()
        if victim is None or gain - self._saved(self.expected_rate(victim)) <= self._threshold:
            return SERVED[Tier.MISS]
        self._stage.remove(victim)
        self._stage.add(uid)
        return Access(Tier.MISS, admit=True, evict=victim)

    def _saved(self, rate: float) -> float:
        """Blobs a slot saves over the horizon for an expert of expected reuse `rate`: its expected
        uses (an unbounded horizon compares rates)."""
        return rate * self.horizon if math.isfinite(self.horizon) else rate

    def _touch(self, uid: int) -> float:
        """Note `uid`'s value now, as accessed in this step; returns it (its expected reuse)."""
        rate = self.expected_rate(uid)
        self._touched[uid] = rate
        heapq.heappush(self._touched_heap, (rate, uid))
        return rate

    def _stage_victim(self) -> int | None:
        """The least valuable STAGE entry outside the current group (ties to the lower uid)."""
        if self._victims is None:
            self._victims = self._ranked(self._stage).tolist()
            self._next_victim = 0
        victims = self._victims
        while self._next_victim < len(victims) and (victims[self._next_victim] not in self._stage
                                                    or victims[self._next_victim] in self._touched):
            self._next_victim += 1
        untouched = next((uid for uid in victims[self._next_victim:] if uid in self._stage
                          and uid not in self._touched), None)
        touched = self._touched_victim()
        candidates = [(self._touched[uid] if uid in self._touched else self.expected_rate(uid), uid)
                      for uid in (untouched, touched) if uid is not None]
        return min(candidates)[1] if candidates else None

    def _touched_victim(self) -> int | None:
        """The least valuable STAGE entry accessed in this step that may go now, from the heap."""
        heap, held = self._touched_heap, []
        found = None
        while heap:
            rate, uid = heap[0]
            if uid not in self._stage or self._touched.get(uid) != rate:
                heapq.heappop(heap)  # left STAGE, or valued again since
            elif uid in self._group:
                held.append(heapq.heappop(heap))  # not now, maybe later in the step
            else:
                found = uid
                break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def _valued(self, uids: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """`uids` as an array, and their expected reuse."""
        array = np.fromiter(uids, dtype=np.int64, count=len(uids))
        return array, self._rates(array)

    def _ranked(self, uids: set[int]) -> np.ndarray:
        """`uids` by expected reuse, least first (ties: lower uid first)."""
        return _by_rate(*self._valued(uids))

    def resident(self) -> set[int]:
        return self._hot | self._stage

    def tier_of(self, uid: int) -> Tier:
        if uid in self._hot:
            return Tier.HOT
        return Tier.STAGE if uid in self._stage else Tier.MISS

    def end_step(self, tokens: int) -> None:
        self._touched.clear()
        self._touched_heap.clear()
        self._victims = None
        self._heat.advance(tokens)
        if math.isfinite(self.horizon):
            kept = self.config.heat_decay ** tokens
            self._evidence = self._evidence * kept + self.horizon * (1 - kept)
        else:
            self._evidence += tokens
        self._tokens += tokens
        if self._tokens >= self.config.rebalance_interval:
            self._tokens = 0
            self.rebalance()

    def rebalance(self) -> list[tuple[int, int]]:
        """One rebalancing pass: at most `max_swaps` STAGE entries worth more than HOT's least
        valuable residents swap tiers with them, best candidate against worst resident.

        Returns:
            The (promoted, demoted) uid pairs, in the order they were swapped.
        """
        (hot, hot_rates), (stage, stage_rates) = self._valued(self._hot), self._valued(self._stage)
        if not (hot.size and stage.size) or stage_rates.max() <= hot_rates.min():
            return []  # no STAGE entry is worth more than HOT's least valuable resident
        victims = _by_rate(hot, hot_rates)[: self.config.max_swaps].tolist()
        candidates = _by_rate(stage, stage_rates, descending=True).tolist()
        swaps = []
        for promoted, demoted in zip(candidates, victims):
            if self.expected_rate(promoted) <= self.expected_rate(demoted):
                break
            self._hot.remove(demoted)
            self._stage.remove(promoted)
            self._hot.add(promoted)
            self._stage.add(demoted)
            swaps.append((promoted, demoted))
        return swaps


def _by_rate(uids: np.ndarray, rates: np.ndarray, descending: bool = False) -> np.ndarray:
    """`uids` by their `rates`, least first (ties: lower uid first), or most first (higher uid first)."""
    return uids[np.lexsort((-uids, -rates) if descending else (uids, rates))]


def make_policy(
    name: str,
    capacity: int,
    total_experts: int,
    config: CacheConfig = CacheConfig(),
    profile: Popularity | None = None,
    stage_slots: int | None = None,
) -> Policy:
    """Build a policy by name (the names of `mira.cache.config.POLICIES`).

    Args:
        name: mira, lru, lfu, static or on-demand.
        capacity: expert slots.
        total_experts: experts over all MoE layers (the mira policy's VRAM mode depends on it).
        config: interval, swap bound, heat decay, prior weight and STAGE fractions of the mira policy.
        profile: routed tokens per uid in recorded routing (`RoutingTrace.popularity()`): required
            by static, the prior of mira, ignored by the others.
        stage_slots: STAGE size of the mira policy instead of the one `split_slots` gives.

    Returns:
        A fresh policy with no history (static, and mira with a profile: with its placement resident).

    Raises:
        ValueError: an unknown name, or static without a profile.
    """
    kind = policy_class(name)
    if kind is MiraPolicy:
        return MiraPolicy(capacity, total_experts, config, stage_slots=stage_slots, prior=profile)
    if kind is Static:
        if profile is None:
            raise ValueError("the static policy needs a profile of routed tokens per expert (a routing trace)")
        return Static(capacity, profile)
    return kind(capacity)


_POLICIES: dict[str, type[Policy]] = {"mira": MiraPolicy, "lru": LRU, "lfu": LFU, "static": Static,
                                      "on-demand": OnDemand}


def policy_class(name: str) -> type[Policy]:
    """The policy class of a name of `mira.cache.config.POLICIES`.

    Raises:
        ValueError: an unknown name.
    """
    if name not in _POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(_POLICIES)}")
    return _POLICIES[name]


def stage_slots(name: str, capacity: int, total_experts: int, config: CacheConfig) -> int:
    """The STAGE slots policy `name` keeps at `capacity` slots (only mira has a STAGE tier), without building it."""
    return split_slots(capacity, total_experts, config)[1] if policy_class(name) is MiraPolicy else 0
