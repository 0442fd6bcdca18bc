"""Which experts occupy the expert slots: policy on plain integers, no tensors (DESIGN.md 2.6).

An expert is identified by a uid, `layer_position * num_experts + expert` (layer_position counts MoE
layers only). The mechanism (`mira.cache.cache.ExpertCache`, or the simulator) replays accesses in
a fixed order: token step by token step, MoE layer by MoE layer, and within one (step, layer) group
each distinct routed expert once, in ascending id. For every access the policy answers where the
expert is served from and what changes in residency; the mechanism carries that out (copies, slot
hand-overs). A policy never evicts an expert accessed in the current group, so every expert of a
layer call stays resident until the layer has computed (capacity >= experts per layer is required).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass


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


class Policy(ABC):
    """A cache replacement policy over `capacity` expert slots."""

    name: str = "policy"

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._group: set[int] = set()

    def begin_group(self) -> None:
        """A new (token step, layer) group starts: experts of the previous group may be evicted again."""
        self._group.clear()

    def access(self, uid: int, tokens: int) -> Access:
        """Expert `uid` is routed `tokens` tokens in the current group."""
        self._group.add(uid)
        return self._access(uid, tokens)

    @abstractmethod
    def _access(self, uid: int, tokens: int) -> Access: ...

    @abstractmethod
    def resident(self) -> set[int]:
        """The uids that hold a slot now."""

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
            return Access(Tier.HOT)
        if self.capacity == 0:
            return Access(Tier.MISS)
        victim = None
        if len(self._order) >= self.capacity:
            victim = next((u for u in self._order if self._evictable(u)), None)
            if victim is None:
                return Access(Tier.MISS)  # every slot holds an expert of this group
            del self._order[victim]
        self._order[uid] = None
        return Access(Tier.MISS, admit=True, evict=victim)

    def resident(self) -> set[int]:
        return set(self._order)
