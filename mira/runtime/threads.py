"""How many CPU threads torch computes with: the physical cores this process may run on, less the
cores other processes keep busy.

torch starts one compute thread per logical CPU, and its threads wait for each other at the end of
every operation. When another process holds a core, the thread sharing that core runs only in its
time slices and every operation waits for it: on a 2-core machine with one core busy, decoding
with two threads ran far slower than with one (benchmarks/cpu_contention.py measures it). Hyper-
threads share a core's arithmetic units, so physical cores are counted, not logical CPUs.

Each thread that starts parallel work keeps a team of its own (mira.runtime.cpu_worker). libgomp,
torch's OpenMP in the Linux wheels, lets a team's threads spin at its barriers while it manages no
more threads than there are CPUs; beyond that they spin briefly and sleep, and every operation then
pays for waking them. A loading thread's idle team plus a CPU worker's team of as many threads is
beyond it, so `free_idle_team` lets the idle one go (OpenMP's `omp_pause_resource_all`); the thread
gets a new team at its next parallel operation.
"""

from __future__ import annotations

import ctypes
import os
import time
from functools import cache
from pathlib import Path

from mira.runtime import hostcpu

BUSY_SAMPLE_S = 0.1  # how long CPU use is sampled before choosing
PROC_MAPS = Path("/proc/self/maps")
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads stopped, state kept


def set_threads(requested: int | None) -> int:
    """Set torch's compute threads: `requested`, else OMP_NUM_THREADS when the user set it, else
    `choose_threads()`. Returns the number in use."""
    import torch

    if requested is None and not os.environ.get("OMP_NUM_THREADS"):
        requested = choose_threads()
    if requested is not None:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


def free_idle_team() -> bool:
    """Let the calling thread's OpenMP team go (its threads exit) where torch computes through libgomp.
    Returns whether there was a runtime to ask and it agreed (False elsewhere, or inside a parallel region)."""
    omp = _libgomp()
    return omp is not None and omp.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch computes through, or None (another runtime, or not Linux)."""
    try:
        path = libgomp_path(PROC_MAPS.read_text())
    except OSError:
        return None
    if path is None:
        return None
    omp = ctypes.CDLL(path)
    return omp if hasattr(omp, "omp_pause_resource_all") else None


def libgomp_path(maps: str) -> str | None:
    """The libgomp among the libraries a /proc/PID/maps text lists: torch's wheels' own copy where
    another package loaded one too; None where none is loaded."""
    loaded = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line},
                    key=lambda path: ("/torch" not in path, path))
    return loaded[0] if loaded else None


def choose_threads() -> int:
    """Physical cores available to this process less the cores busy with other work (at least 1)."""
    cpus = usable_cpus()
    return threads_for(physical_cores(cpus), len(cpus), busy_cpus(cpus))


def threads_for(physical: int, logical: int, busy: float) -> int:
    """Threads for `physical` cores of `logical` CPUs of which `busy` are in use: the cores left idle,
    rounded to the nearest, at least 1 (a core counts as busy in the share its CPUs are)."""
    idle_share = max(0.0, 1 - busy / logical)
    return max(1, int(physical * idle_share + 0.5))


def physical_cores(cpus: list[int]) -> int:
    """Distinct (package, core) pairs among `cpus`; the number of CPUs where topology is not exposed."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package, core = (topology / "physical_package_id").read_text(), (topology / "core_id").read_text()
        except OSError:
            return len(cpus)
        cores.add((package.strip(), core.strip()))
    return len(cores)


def busy_cpus(cpus: list[int], interval: float = BUSY_SAMPLE_S) -> float:
    """How many of `cpus` were busy (not idle or waiting for I/O) over `interval` seconds, from
    /proc/stat; 0 where that is not readable. This process sleeps meanwhile, so the figure is others'."""
    before = _cpu_times(cpus)
    time.sleep(interval)
    after = _cpu_times(cpus)
    busy = 0.0
    for cpu, (idle_after, total_after) in after.items():
        idle_before, total_before = before.get(cpu, (idle_after, total_after))
        total = total_after - total_before
        if total > 0:
            busy += 1 - (idle_after - idle_before) / total
    return busy


def _cpu_times(cpus: list[int]) -> dict[int, tuple[int, int]]:
    """{cpu: (idle + iowait ticks, all ticks)} from /proc/stat."""
    lines = hostcpu.ticks()
    return {cpu: (line[hostcpu.IDLE] + line[hostcpu.IOWAIT], sum(line)) for cpu in cpus
            if (line := lines.get(f"cpu{cpu}")) is not None}


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity on Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))
