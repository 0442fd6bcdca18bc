"""Belady's optimum: the fewest misses any policy can have on a known access sequence (DESIGN.md 2.6, 4).

Offline and future-knowing, so it is a bound rather than a policy: `mira simulate` reports it next
to the online policies of paper IV-D, and the PCIe lower bound of DESIGN.md 4 is its miss count
times the expert blob size; both let it start holding any experts (`warm_belady_misses`), as a
placement loaded with the model does. Mira's zero-copy miss path (DESIGN.md 2.8) serves a miss straight from
the host store, so a miss need not be admitted; with that bypass allowed the optimum is Belady's
MIN rule with one change: on a miss with every slot taken, the expert whose next use lies furthest
in the future is the one that does not hold a slot afterwards, and that may be the requested
expert itself. Ties (several experts never used again) do not change the count.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def next_uses(sequence: Sequence[int] | np.ndarray) -> list[int]:
    """For every position, the position of the next access to the same uid.

    Args:
        sequence: uids in access order, N of them.

    Returns:
        N positions; N (past the end) where the uid is not accessed again.
    """
    uids = [int(uid) for uid in sequence]
    following = [len(uids)] * len(uids)
    seen: dict[int, int] = {}
    for position in range(len(uids) - 1, -1, -1):
        following[position] = seen.get(uids[position], len(uids))
        seen[uids[position]] = position
    return following


def belady_misses(sequence: Sequence[int] | np.ndarray, slots: int) -> int:
    """The minimum number of misses over all admission and eviction choices, bypass allowed.

    O(N log N): next uses precomputed, residents in a max-heap on their next use (entries made
    stale by a later access are skipped when they surface).

    Args:
        sequence: uids in access order (`RoutingTrace.uid_sequence()` for a trace).
        slots: expert slots, >= 0.

    Returns:
        The optimal miss count; the first access of each uid is always a miss.

    Raises:
        ValueError: negative slot count.
    """
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    uids = [int(uid) for uid in sequence]
    following = next_uses(uids)
    resident: dict[int, int] = {}  # uid -> its next use
    furthest: list[tuple[int, int]] = []  # (-next use, uid), possibly stale
    misses = 0
    for position, uid in enumerate(uids):
        upcoming = following[position]
        if uid not in resident:
            misses += 1
            if slots == 0:
                continue
            if len(resident) >= slots:
                victim, victim_next = _furthest(furthest, resident)
                if victim_next <= upcoming:
                    continue  # bypass: the requested expert is the one needed last
                del resident[victim]
                heapq.heappop(furthest)
        resident[uid] = upcoming
        heapq.heappush(furthest, (-upcoming, uid))
    return misses


def warm_belady_misses(sequence: Sequence[int] | np.ndarray, slots: int) -> int:
    """The minimum number of misses when the slots may start holding any experts (bypass allowed):
    the bound for a policy whose placement is loaded with the model. The optimal start holds the
    first `slots` distinct uids in order of first use (a cold start fills its free slots with them
    without an eviction), so this is the cold optimum less those first loads."""
    uids = np.asarray(sequence, dtype=np.int64)
    if slots == 0:
        return len(uids)
    _, first = np.unique(uids, return_index=True)
    preload = uids[np.sort(first)][:slots]  # distinct uids in order of first use
    return belady_misses(np.concatenate([preload, uids]), slots) - len(preload)


def _furthest(furthest: list[tuple[int, int]], resident: dict[int, int]) -> tuple[int, int]:
    """The resident with the furthest next use, after dropping stale heap entries from the top."""
    while True:
        negative_next, uid = furthest[0]
        if resident.get(uid) == -negative_next:
            return uid, -negative_next
        heapq.heappop(furthest)
