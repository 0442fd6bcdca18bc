"""Belady's optimum with bypass: hand-worked cases and exhaustive search on small sequences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from belady_reference import brute_force_misses
from mira.cache.belady import belady_misses, next_uses, warm_belady_misses


def test_next_uses_points_at_the_next_access_or_past_the_end():
    assert next_uses([1, 2, 1, 1, 3]) == [2, 5, 3, 5, 5]


@pytest.mark.parametrize(
    ("sequence", "slots", "misses"),
    [
        ([], 3, 0),
        ([1, 1, 1], 0, 3),  # no slots: every access misses
        ([1, 2, 1], 1, 2),  # 2 is bypassed so 1 stays: admitting 2 would cost a third miss
        ([1, 2, 3, 1, 2, 3], 2, 4),  # 3 is needed last, so it is the one not kept
        ([1, 2, 3, 4, 1, 2, 3, 4], 3, 5),  # loop one larger than the cache: LRU misses all 8
        ([1, 2, 3, 2, 1, 3], 2, 4),
        ([5, 6, 5, 6, 7, 5, 6], 2, 3),  # 7 bypassed
    ],
)
def test_hand_worked_cases(sequence, slots, misses):
    assert belady_misses(sequence, slots) == misses
    assert brute_force_misses(sequence, slots) == misses


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=11), st.integers(0, 4))
def test_matches_exhaustive_search(sequence, slots):
    assert belady_misses(sequence, slots) == brute_force_misses(sequence, slots)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=200), st.integers(0, 12))
def test_never_fewer_misses_than_distinct_uids_nor_more_with_more_slots(sequence, slots):
    misses = belady_misses(sequence, slots)
    assert len(set(sequence)) <= misses <= len(sequence)
    assert belady_misses(sequence, slots + 1) <= misses
    if slots >= len(set(sequence)):
        assert misses == len(set(sequence))


def test_negative_slots_are_refused():
    with pytest.raises(ValueError, match="slots must be >= 0"):
        belady_misses([1], -1)


def brute_force_warm_misses(sequence: list[int], slots: int) -> int:
    """The fewest misses over every starting cache content and every later choice (bypass allowed)."""
    distinct = sorted(set(sequence))
    starts = itertools.combinations(distinct, min(slots, len(distinct)))
    return min(brute_force_misses(sequence, slots, frozenset(start)) for start in starts)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(0, 4))
def test_warm_belady_matches_exhaustive_search_over_starting_contents(sequence, slots):
    assert warm_belady_misses(np.array(sequence), slots) == brute_force_warm_misses(sequence, slots)
