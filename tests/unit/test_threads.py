"""The CPU thread count: the physical cores left idle by other processes."""

import os

from mira.runtime.threads import busy_cpus, physical_cores, threads_for


def test_threads_are_the_idle_physical_cores_hand_worked():
    assert threads_for(physical=2, logical=2, busy=0.02) == 2  # an idle 2-core machine
    assert threads_for(physical=2, logical=2, busy=1.0) == 1  # one core spinning elsewhere
    assert threads_for(physical=2, logical=2, busy=0.6) == 1  # a core mostly busy counts as busy
    assert threads_for(physical=2, logical=2, busy=2.0) == 1  # never fewer than one
    assert threads_for(physical=8, logical=16, busy=0.0) == 8  # hyper-threads are not cores
    assert threads_for(physical=8, logical=16, busy=4.0) == 6  # 4 of 16 CPUs busy: a quarter of the cores
    assert threads_for(physical=16, logical=16, busy=3.2) == 13


def test_cpu_use_and_topology_are_read_within_their_bounds():
    cpus = sorted(os.sched_getaffinity(0))
    assert 1 <= physical_cores(cpus) <= len(cpus)
    assert 0.0 <= busy_cpus(cpus, interval=0.05) <= len(cpus) + 1e-6
