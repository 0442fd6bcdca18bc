"""The host's stolen CPU time from /proc/stat, on hand-written readings, and as `repeated` records it."""

import sys

import pytest

from mira.runtime import hostcpu
from mira.bench.measure import Timing, repeated

STAT = """cpu  100 20 30 800 10 5 5 30 0 0
cpu0 50 10 15 400 5 2 3 15 0 0
intr 12345
"""


def test_each_cpu_line_gives_eight_fields_and_the_aggregate_its_total_and_steal(tmp_path):
    assert hostcpu.parse(STAT) == {"cpu": [100, 20, 30, 800, 10, 5, 5, 30], "cpu0": [50, 10, 15, 400, 5, 2, 3, 15]}
    assert hostcpu.parse("cpu 1 2 3 4\n") == {"cpu": [1, 2, 3, 4, 0, 0, 0, 0]}  # an old kernel: no steal field
    (tmp_path / "stat").write_text(STAT)
    assert hostcpu.read(tmp_path / "stat") == hostcpu.CpuTimes(total=1000, steal=30)
    (tmp_path / "stat").write_text("cpu0 1 2 3 4 5 6 7 8\n")
    assert hostcpu.read(tmp_path / "stat") is None  # no aggregate line


def test_the_stolen_share_is_the_steal_over_all_time_between_readings():
    before, after = hostcpu.CpuTimes(total=1000, steal=30), hostcpu.CpuTimes(total=1800, steal=90)
    assert hostcpu.stolen_share(before, after) == 60 / 800
    assert hostcpu.stolen_share(before, before) is None  # no tick passed
    assert hostcpu.stolen_share(None, after) is None


def test_without_proc_stat_there_is_no_reading(tmp_path):
    assert hostcpu.read(tmp_path / "stat") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_linux_readings_grow_and_steal_is_a_part_of_the_total():
    first = hostcpu.read()
    sum(i * i for i in range(2_000_000))  # a few ticks of work
    second = hostcpu.read()
    assert second.total > first.total and 0 <= second.steal - first.steal <= second.total - first.total


def test_repeated_records_each_timed_runs_share_and_the_whole(monkeypatch):
    # readings before and after each of two timed runs (the untimed one is not read)
    readings = iter([hostcpu.CpuTimes(1000, 0), hostcpu.CpuTimes(1400, 40), hostcpu.CpuTimes(2000, 40)])
    monkeypatch.setattr(hostcpu, "read", lambda: next(readings))

    def run():
        timing = Timing()
        timing.add(4, 3, 0.0, [0.0, 0.1, 0.2, 0.3], 0.3)
        return timing

    result = repeated(run, 2)
    assert [r["host_cpu_stolen"] for r in result["repeats"]] == [0.1, 0.0]
    assert result["host_cpu_stolen"] == 0.04  # 40 of 1,000 ticks


def test_repeated_records_nothing_where_the_host_cannot_be_read(monkeypatch):
    monkeypatch.setattr(hostcpu, "read", lambda: None)
    timing = Timing()
    timing.add(4, 3, 0.0, [0.0, 0.1, 0.2, 0.3], 0.3)
    result = repeated(lambda: timing, 2)
    assert "host_cpu_stolen" not in result and all("host_cpu_stolen" not in r for r in result["repeats"])
