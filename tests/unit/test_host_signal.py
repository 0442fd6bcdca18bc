"""A CUDA stream held by a host semaphore (mira.runtime.host_signal): work enqueued after a hold
runs only once the host posts, and each post releases one hold (needs a GPU); a post no hold
matches is taken back, and only a post that was made (on the CPU too)."""

import time

import pytest
import torch

from mira.runtime.host_signal import HostSignal

def test_take_takes_back_posts_one_each_and_refuses_when_none_is_left():
    signal = HostSignal()
    with pytest.raises(RuntimeError, match="no post is left"):
        signal.take()
    signal.post()
    signal.post()
    signal.take()
    signal.take()
    with pytest.raises(RuntimeError, match="no post is left"):
        signal.take()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_post_taken_back_leaves_the_next_hold_waiting():
    signal = HostSignal()
    host = torch.zeros(1, dtype=torch.int64).pin_memory()
    signal.post()  # a job whose layer failed before its hold
    signal.take()
    signal.hold()
    host.copy_(torch.ones(1, dtype=torch.int64, device="cuda"), non_blocking=True)
    time.sleep(0.2)
    assert not torch.cuda.current_stream().query() and host.item() == 0
    signal.post()
    torch.cuda.current_stream().synchronize()
    assert host.item() == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_held_stream_runs_its_later_work_after_each_post():
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
