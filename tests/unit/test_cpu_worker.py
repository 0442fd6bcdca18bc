"""The CPU expert worker: the executor's results through a thread of its own thread count, and the
host buffers that carry a layer's rows to it and its partial sum back."""

import math

import pytest
import torch
import torch.nn.functional as F

from mira.kernels.cpu_experts import CpuExpertFFN
from mira.kernels.reference import moe_ffn_reference
from mira.runtime.cpu_worker import CpuExpertWorker, HostRows
from mira.runtime.threads import _libgomp
from mira.store.layout import ExpertLayout
from mira.store.quant import quantize_expert
from os_threads import in_a_thread, os_threads, settled_threads

H, I, E, K = 64, 48, 6, 2


def layer(scheme: str, tokens: int, seed: int = 0):
    dtype = torch.bfloat16 if scheme == "none" else torch.int8
    layout = ExpertLayout(scheme, H, I, dtype)
    g = torch.Generator().manual_seed(seed)
    blobs = []
    for _ in range(E):
        blob = torch.empty(layout.nbytes, dtype=torch.uint8)
        w13, w2 = torch.randn(2 * I, H, generator=g) / math.sqrt(H), torch.randn(H, I, generator=g) / math.sqrt(I)
        layout.pack(quantize_expert(w13, w2, layout), blob)
        blobs.append(blob)
    hidden = torch.randn(tokens, H, generator=g).bfloat16()
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])  # [T, K]
    weights = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)  # [T, K]
    return layout, blobs, hidden, index, weights


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.parametrize("scheme", ["int8-row", "int8-shared", "none"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_worker_output_is_the_executors(scheme, tokens):
    layout, blobs, hidden, index, weights = layer(scheme, tokens)
    ffn = CpuExpertFFN(layout, F.silu)
    experts = index.unique().tolist()[::2]
    rows = HostRows(8, H, K, hidden.dtype, "cpu")
    with CpuExpertWorker(ffn, threads=1) as worker:
        job = rows.stage(hidden, index, weights, 0, experts, blobs)
        job.out.fill_(float("nan"))
        result = worker.submit(job).result(timeout=60)
    assert result.data_ptr() == rows.out.data_ptr()
    assert torch.equal(result, ffn(hidden, index, weights, blobs, experts, out=torch.empty(tokens, H)))


@pytest.mark.parametrize("scheme", ["int8-row", "int8-shared"])
def test_gpu_share_plus_worker_share_is_the_whole_layer(scheme):
    """What the runtime does: the device computes some experts, the worker the others, add_into sums."""
    tokens = 5
    layout, blobs, hidden, index, weights = layer(scheme, tokens, seed=1)
    routed = index.unique().tolist()
    cpu_experts = routed[1::2]
    device_blobs = [None if e in cpu_experts else b for e, b in enumerate(blobs)]
    device_index = index.clone()
    device_weights = weights.clone()
    for e in cpu_experts:  # the device share: route the CPU's pairs to a device expert with weight 0
        device_weights[index == e] = 0
        device_index[index == e] = routed[0]
    out = moe_ffn_reference(hidden.float(), device_index, device_weights, device_blobs, layout, F.silu)
    rows = HostRows(8, H, K, hidden.dtype, "cpu")
    with CpuExpertWorker(CpuExpertFFN(layout, F.silu), threads=1) as worker:
        job = rows.stage(hidden, index, weights, 3, cpu_experts, blobs)
        rows.add_into(out, worker.submit(job).result(timeout=60))
    exact = moe_ffn_reference(hidden.double(), index, weights.double(), blobs, layout, F.silu)
    # bf16 products: a few units of bf16 roundoff of the output's size
    assert (out.double() - exact).abs().max() <= 8 * torch.finfo(torch.bfloat16).eps * exact.abs().max()


def test_worker_keeps_its_thread_count_and_leaves_the_callers(restore_threads):
    torch.set_num_threads(2)
    layout, blobs, hidden, index, weights = layer("int8-row", 3)
    with CpuExpertWorker(CpuExpertFFN(layout, F.silu), threads=1) as worker:
        assert worker.threads == 1 and worker.own_threads
        assert torch.get_num_threads() == 2
        rows = HostRows(4, H, K, hidden.dtype, "cpu")
        worker.submit(rows.stage(hidden, index, weights, 0, [0, 1, 2], blobs)).result(timeout=60)
        assert worker.call(torch.get_num_threads).result(timeout=60) == 1  # after its parallel products too
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(_libgomp() is None, reason="torch computes through another OpenMP runtime here")
def test_a_worker_lets_its_callers_idle_team_go():
    layout = layer("int8-row", 1)[0]

    def run():
        torch.set_num_threads(2)
        torch.arange(1 << 16, dtype=torch.float32).add_(1)  # above the elementwise grain: the caller's team
        before = os_threads()
        with CpuExpertWorker(CpuExpertFFN(layout, F.silu), threads=1):  # one thread: no team of its own
            return before, settled_threads(before)  # its thread in, the caller's team's other thread out
    before, during = in_a_thread(run)
    assert during == before


def test_an_error_reaches_the_waiter_and_the_worker_goes_on():
    layout, blobs, hidden, index, weights = layer("int8-shared", 2)
    rows = HostRows(2, H, K, hidden.dtype, "cpu")
    routed = index.unique().tolist()
    with CpuExpertWorker(CpuExpertFFN(layout, F.silu), threads=1) as worker:
        missing = [None] * E
        with pytest.raises(ValueError, match="no blob"):
            worker.submit(rows.stage(hidden, index, weights, 0, routed, missing)).result(timeout=60)
        assert worker.submit(rows.stage(hidden, index, weights, 0, routed, blobs)).result(timeout=60).isfinite().all()
    with pytest.raises(RuntimeError, match="closed"):
        worker.call(torch.get_num_threads)


def test_host_rows_refuse_a_call_larger_than_they_hold():
    layout, blobs, hidden, index, weights = layer("int8-row", 5)
    with pytest.raises(ValueError, match="exceeds"):
        HostRows(4, H, K, hidden.dtype, "cpu").stage(hidden, index, weights, 0, [0], blobs)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_rows_go_to_the_worker_and_back_through_pinned_buffers():
    layout, blobs, hidden, index, weights = layer("int8-row", 6, seed=2)
    blobs = [b.pin_memory() for b in blobs]
    ffn = CpuExpertFFN(layout, F.silu)
    experts = index.unique().tolist()
    rows = HostRows(8, H, K, hidden.dtype, "cuda")
    assert rows.hidden.is_pinned() and rows.out.is_pinned()
    out = torch.zeros(6, H, dtype=torch.bfloat16, device="cuda")
    with CpuExpertWorker(ffn, threads=2) as worker:
        job = rows.stage(hidden.cuda(), index.cuda(), weights.cuda(), 0, experts, blobs)
        rows.add_into(out, worker.submit(job).result(timeout=60))
    expected = ffn(hidden, index, weights, blobs, experts).float().to(torch.bfloat16)
    assert torch.equal(out.cpu(), expected)


def test_the_worker_calls_done_after_a_job_and_after_a_failed_one():
    layout, blobs, hidden, index, weights = layer("int8-row", 3, seed=4)
    rows = HostRows(4, H, K, hidden.dtype, "cpu")
    calls = []
    with CpuExpertWorker(CpuExpertFFN(layout, F.silu), threads=1) as worker:
        job = rows.stage(hidden, index, weights, 0, index.unique().tolist(), blobs, done=lambda: calls.append("ok"))
        worker.submit(job).result(timeout=60)
        assert calls == ["ok"] and job.finished >= job.compute_s > 0
        missing = [None] * len(blobs)  # no blob for an expert it is to compute: the job fails
        failed = rows.stage(hidden, index, weights, 0, [int(index[0, 0])], missing, done=lambda: calls.append("failed"))
        with pytest.raises(ValueError, match="no blob"):
            worker.submit(failed).result(timeout=60)
    assert calls == ["ok", "failed"]
