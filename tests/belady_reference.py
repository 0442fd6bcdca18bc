"""Exhaustive search for the fewest cache misses: the independent reference Belady's optimum is
tested against (tests/unit/test_belady.py, tests/unit/test_bench_bound.py)."""

from __future__ import annotations

from functools import lru_cache


def brute_force_misses(sequence: list[int], slots: int, start: frozenset[int] = frozenset()) -> int:
    """The fewest misses over every choice: on a miss, bypass, take a free slot, or evict any resident.

    `start`: the experts resident before the first access (at most `slots` of them).
    """

    @lru_cache(maxsize=None)
    def best(position: int, resident: frozenset[int]) -> int:
        if position == len(sequence):
            return 0
        uid = sequence[position]
        if uid in resident:
            return best(position + 1, resident)
        options = [best(position + 1, resident)]  # bypass
        if len(resident) < slots:
            options.append(best(position + 1, resident | {uid}))
        for victim in resident:
            options.append(best(position + 1, (resident - {victim}) | {uid}))
        return 1 + min(options)

    return best(0, start)
