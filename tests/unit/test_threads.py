"""The CPU thread count: the physical cores left idle by other processes."""

import os

import pytest
import torch

from mira.runtime.threads import _libgomp, busy_cpus, free_idle_team, libgomp_path, physical_cores, threads_for
from os_threads import in_a_thread, os_threads, settled_threads


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


@pytest.mark.skipif(_libgomp() is None, reason="torch computes through another OpenMP runtime here")
def test_an_idle_team_is_let_go_and_a_new_one_made_at_the_next_parallel_operation():
    def run():
        torch.set_num_threads(2)
        x = torch.arange(1 << 16, dtype=torch.float32)  # above the elementwise grain: runs on the team
        torch.testing.assert_close(x + 1, torch.arange(1, (1 << 16) + 1, dtype=torch.float32))
        with_team = os_threads()
        freed = free_idle_team()
        without = settled_threads(with_team - 1)
        torch.testing.assert_close(x * 2, torch.arange(0, 1 << 17, 2, dtype=torch.float32))
        return freed, with_team, without, settled_threads(with_team)
    freed, with_team, without, again = in_a_thread(run)
    assert freed
    assert without == with_team - 1  # the team's other thread exited
    assert again == with_team


def test_torchs_own_libgomp_is_taken_where_another_is_loaded_too():
    system = "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libgomp.so.1"
    wheel = "7f20-7f30 r-xp 00000000 08:01 2 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
    other = "7f40-7f50 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libc.so.6"
    assert libgomp_path("\n".join([system, other, wheel])) == wheel.split()[-1]
    assert libgomp_path("\n".join([other, system])) == system.split()[-1]
    assert libgomp_path(other) is None
