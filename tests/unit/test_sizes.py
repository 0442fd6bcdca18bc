"""Sizes in messages: the largest binary unit not above them, and read back as written."""

from __future__ import annotations

import pytest

from mira.cache.budget import format_size, parse_size


@pytest.mark.parametrize(("nbytes", "shown"), [
    (0, "0 B"), (12, "12 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (393_728, "384.50 KiB"),
    (12 << 20, "12.00 MiB"), (3 << 30, "3.00 GiB"), ((3 << 30) + (1 << 20), "3.00 GiB"),
])
def test_a_size_is_shown_in_the_largest_unit_not_above_it(nbytes, shown):
    assert format_size(nbytes) == shown


def test_a_minimum_is_rounded_up_and_what_is_shown_reads_back():
    assert format_size((3 << 30) + (1 << 20), up=True) == "3.01 GiB"  # 3.00098 GiB: asking for 3.00 falls short
    for nbytes in (12, 393_728, (12 << 20) + 1, (3 << 30) + (1 << 20)):
        assert parse_size(format_size(nbytes, up=True)) >= nbytes
