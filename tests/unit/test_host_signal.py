"""A CUDA stream held by a host semaphore (mira.runtime.host_signal): work enqueued after a hold
runs only once the host posts, and each post releases one hold. Needs a GPU."""

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_held_stream_runs_its_later_work_after_each_post():
    from mira.runtime.host_signal import HostSignal

    signal = HostSignal()
    host = torch.zeros(2, dtype=torch.int64).pin_memory()
    ones = torch.ones(2, dtype=torch.int64, device="cuda")
    signal.hold()
    host[0:1].copy_(ones[0:1], non_blocking=True)
    signal.hold()
    host[1:2].copy_(ones[1:2], non_blocking=True)
    stream = torch.cuda.current_stream()
    time.sleep(0.2)
    assert not stream.query() and host.tolist() == [0, 0]  # held before the first copy
    signal.post()
    time.sleep(0.2)
    assert not stream.query() and host.tolist() == [1, 0]  # the first copy ran, the second hold waits
    signal.post()
    stream.synchronize()
    assert host.tolist() == [1, 1]
