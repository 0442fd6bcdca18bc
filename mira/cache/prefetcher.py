"""Predictive staging: the bookkeeping of prefetches into STAGE (paper IV-C, IV-E).

After layer i's routing, the predictor's best expert for layer i+2 is offered to the policy's
STAGE region (`Policy.stage`): an expert already resident is skipped, one the policy admits is
copied ahead of use, one it declines is left to the miss path. The book remembers which staged
experts wait for which layer; once that layer has computed, they are released, used or not: the
slot is reclaimed right after use, as in the paper's small-VRAM mode. Until then no miss and no
other prediction may take a staged expert's slot (mira.cache.policy.MiraPolicy).

A prefetch that its layer uses replaces the copy its miss would have made; it hides a copy, it does
not save one, while a wasted prefetch and the cache entry a staged expert displaced each cost one
more. So only the best prediction per target layer is staged (`benchmarks/prefetch.py` measures misses
and copies with and without). Even perfect predictions move more bytes than none, since a staged
expert holds a slot the cache would have used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice

from mira.cache.policy import Access, Policy, Tier


@dataclass
class PrefetchCounts:
    issued: int = 0  # admitted into STAGE: a copy ahead of use
    skipped: int = 0  # already resident (HOT or STAGE)
    declined: int = 0  # STAGE had no room
    used: int = 0  # staged and then routed at its target layer
    wasted: int = 0  # staged and not routed there: released

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class PrefetchBook:
    """Staged experts waiting for their target layer.

    per_layer: how many of the predicted experts of a target layer are offered to the policy,
        best first; the rest are left to the miss path.
    """

    per_layer: int = 1
    counts: PrefetchCounts = field(default_factory=PrefetchCounts)
    _waiting: dict[int, set[int]] = field(default_factory=dict)  # target layer position -> uids
    _issued_for: dict[int, int] = field(default_factory=dict)  # target layer position -> copies issued

    def stage(self, policy: Policy, target_layer: int, uids: Iterable[int],
              admit: Callable[[int, Access], None]) -> None:
        """Offer the best `per_layer` predicted experts of `target_layer` (`uids`, best first) to the
        policy; `admit(uid, access)` copies one in."""
        waiting = self._waiting.setdefault(target_layer, set())
        for uid in islice(uids, self.per_layer):
            if uid in waiting:
                continue  # already staged for this layer: no duplicate copy
            access = policy.stage(uid)
            if access.tier is not Tier.MISS:
                self.counts.skipped += 1
            elif access.admit:
                admit(uid, access)
                waiting.add(uid)
                self.counts.issued += 1
                self._issued_for[target_layer] = self._issued_for.get(target_layer, 0) + 1
            else:
                self.counts.declined += 1

    def after_layer(self, policy: Policy, layer: int, routed: Iterable[int]) -> list[int]:
        """`layer` has computed with `routed` uids: release what was staged for it and is done.

        Returns:
            The uids released (the mechanism frees their slots).
        """
        # (a policy that gave up a staged expert before its layer came has no slot of it left to free)
        released = sorted(uid for uid in self._waiting.pop(layer, set()) if policy.tier_of(uid) is Tier.STAGE)
        used = len(set(released) & set(routed))
        self.counts.used += used
        self.counts.wasted += self._issued_for.pop(layer, 0) - used
        for uid in released:
            policy.release(uid)
        return released
