"""The host's CPU time from Linux's /proc/stat: each CPU's ticks by kind, and the share a hypervisor
took from this machine over an interval (steal time).

A virtual machine whose host is oversubscribed loses its vCPUs for moments at a time. A CPU share
of the misses runs on every core at once, so its job waits for the slowest of them, and its speed
then varies from run to run while the GPU's side does not; each timed bench run records the share
stolen, so a result says whether its host was contended."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# the first eight fields of a cpu line: user nice system idle iowait irq softirq steal (guest time
# is already counted in user and nice)
FIELDS = 8
IDLE, IOWAIT, STEAL = 3, 4, 7


def ticks(path: Path = PROC_STAT) -> dict[str, list[int]]:
    """{"cpu": [...], "cpu0": [...], ...}: each cpu line's eight fields of ticks since boot (0 where
    an old kernel has none); {} where the system has no /proc/stat (not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    return parse(text)


def parse(text: str) -> dict[str, list[int]]:
    """`ticks` of /proc/stat's text."""
    lines = {}
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu"):
            values = [int(value) for value in fields[:FIELDS]]
            lines[name] = values + [0] * (FIELDS - len(values))
    return lines


@dataclass(frozen=True)
class CpuTimes:
    """The host's summed CPU time since boot, in clock ticks: all of it, and the stolen part."""

    total: int
    steal: int


def read(path: Path = PROC_STAT) -> CpuTimes | None:
    """The host's CPU times now (its aggregate line), or None where they cannot be read."""
    host = ticks(path).get("cpu")
    return None if host is None else CpuTimes(total=sum(host), steal=host[STEAL])


def stolen_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The fraction of the CPU time between two readings that was stolen (None without both, or
    when no tick passed)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
