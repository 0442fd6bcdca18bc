"""The share of the host's CPU time a hypervisor took from this machine over an interval (steal
time, Linux's /proc/stat). A virtual machine whose host is oversubscribed loses its vCPUs for
moments at a time; a CPU share of the misses runs on every core at once, so its job waits for the
slowest of them, and its speed then varies from run to run while the GPU's side does not. Each
timed run records the share, so a result says whether its host was contended."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# the aggregate "cpu" line's first eight fields: user nice system idle iowait irq softirq steal
# (guest time is already counted in user and nice)
FIELDS = 8
STEAL = 7


@dataclass(frozen=True)
class CpuTimes:
    """The host's summed CPU time since boot, in clock ticks: all of it, and the stolen part."""

    total: int
    steal: int


def parse(text: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat's text."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(value) for value in fields[1:1 + FIELDS]]
            ticks += [0] * (FIELDS - len(ticks))  # kernels older than 2.6.11 have no steal field
            return CpuTimes(total=sum(ticks), steal=ticks[STEAL])
    raise ValueError("no aggregate 'cpu' line in /proc/stat's text")


def read(path: Path = PROC_STAT) -> CpuTimes | None:
    """The host's CPU times now, or None where the system has no /proc/stat (not Linux)."""
    try:
        return parse(path.read_text())
    except OSError:
        return None


def stolen_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The fraction of the CPU time between two readings that was stolen (None without both, or
    when no tick passed)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
