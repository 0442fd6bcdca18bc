"""Start-up calibration on the CPU: a well-formed cost model from real timings, and its file."""

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

from mira.cache.costmodel import HybridCosts, LinearCost, split
from mira.errors import MiraError
from mira.kernels.cpu_experts import CpuExpertFFN
from mira.runtime import hybrid
from mira.runtime.calibrate import (FORMAT, MEASUREMENTS, calibrate, costs_path, entry_key, load_costs, save_costs,
                                    saved_measurements)
from mira.runtime.cpu_worker import CpuExpertWorker
from mira.store.layout import ExpertLayout


@pytest.fixture(scope="module")
def worker():
    layout = ExpertLayout("int8-row", 64, 32)
    with CpuExpertWorker(CpuExpertFFN(layout, F.silu), threads=1) as worker:
        yield worker


def test_cpu_only_calibration_measures_the_cpu_and_no_pcie(worker):
    layout = worker.ffn.layout
    blobs = [torch.randint(0, 255, (layout.nbytes,), dtype=torch.uint8) for _ in range(8)]
    costs = calibrate(worker, blobs, "cpu", cpu_budget_s=0.05)
    assert costs.blob_bytes == layout.nbytes and costs.pcie_bytes_per_s is None
    assert costs.cpu(1) > 0 and costs.cpu.per_token_s >= 0 and math.isfinite(costs.cpu(8))
    assert costs.cpu_call_s > 0
    assert math.isinf(costs.pcie_s(1))
    assert split([(0, 1), (3, 1)], layout.nbytes, costs).cpu == [0, 3]  # nothing can go over PCIe


class _SlowEveryFourth:
    """An executor whose experts take 1 ms, except every fourth call 9 ms: median 1 ms, mean 3 ms."""

    def __init__(self, layout):
        self.layout, self.calls = layout, 0

    def expert(self, x, views):
        time.sleep(9e-3 if self.calls % 4 == 3 else 1e-3)
        self.calls += 1
        return x

    def __call__(self, hidden, top_k_index, top_k_weights, blobs, experts, *, out, cut=None):
        return out


def test_the_cpu_figure_is_the_mean_of_the_calls_not_their_median():
    """The cost model adds times up: a slow call in four costs decoding what it costs the mean."""
    layout = ExpertLayout("int8-row", 64, 32)
    blobs = [torch.zeros(layout.nbytes, dtype=torch.uint8) for _ in range(4)]
    with CpuExpertWorker(_SlowEveryFourth(layout), threads=1) as slow:
        costs = calibrate(slow, blobs, "cpu", tokens=(1,), cpu_budget_s=0.25)
    assert slow.ffn.calls >= 8
    assert 2.5e-3 < costs.cpu(1) < 4.5e-3  # sleeps overrun: the mean lies above 3 ms, the median near 1 ms


def test_calibration_needs_blobs(worker):
    with pytest.raises(MiraError, match="blobs"):
        calibrate(worker, [], "cpu")


def test_costs_file_keeps_entries_per_key_and_round_trips(tmp_path, worker):
    path = costs_path("cpu", tmp_path)
    assert path.name == "cpu-hybrid.json"
    key = entry_key(worker)
    assert "1 threads" in key and "64x32" in key and "int8-row" in key
    first = HybridCosts(1000, LinearCost(1e-4, 1e-6), 2e-5, None)
    second = HybridCosts(2000, LinearCost(2e-4, 0.0), 3e-5, 5e10, 4e-6, LinearCost(1e-5, 1e-7))
    assert load_costs(path, key) is None
    save_costs(path, key, first, "test")
    save_costs(path, "another machine", second, "test")
    assert load_costs(path, key) == first and load_costs(path, "another machine") == second
    assert load_costs(path, "missing") is None
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left nothing behind


def test_an_entry_of_an_older_format_is_measured_again(tmp_path, worker):
    path = costs_path("cpu", tmp_path)
    key = entry_key(worker)
    save_costs(path, key, HybridCosts(1000, LinearCost(1e-4, 1e-6), 2e-5, None), "test")
    data = json.loads(path.read_text())
    del data["entries"][key]["format"]  # as format 1 wrote it: median CPU figures
    path.write_text(json.dumps(data))
    assert load_costs(path, key) is None


class _Layer:
    """The store's face that `machine_costs` reads: a layer's blobs."""

    num_experts = 4

    def blob(self, layer, expert):
        return torch.zeros(8, dtype=torch.uint8)


def _cpu_ms(ms: float) -> HybridCosts:
    return HybridCosts(blob_bytes=1 << 20, cpu=LinearCost(ms * 1e-3, 0.0), cpu_call_s=1e-4, pcie_bytes_per_s=None)


def test_a_saved_calibration_that_left_the_share_off_is_measured_again_and_the_faster_cpu_kept(
        tmp_path, monkeypatch, capsys, worker):
    """A calibration taken while the host was busy must not keep auto's share off for good: where
    the saved one does not pay, a load measures again (at most MEASUREMENTS loads) and keeps the
    faster of the two; one that pays, or a mode with no verdict to reach, is read as saved."""
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "stores"))
    readings = iter([_cpu_ms(5.0), _cpu_ms(2.0)])  # a busy moment, then a quiet one
    measured = []
    monkeypatch.setattr(hybrid, "calibrate", lambda worker, blobs, device: measured.append(blobs) or next(readings))
    pays = lambda costs: costs.cpu_s(1) < 3e-3  # noqa: E731
    path = costs_path("cpu", hybrid.calibration_dir())
    key = entry_key(worker)

    assert hybrid.machine_costs(worker, _Layer(), torch.device("cpu"), pays=pays).cpu_s(1) == 5e-3
    assert hybrid.machine_costs(worker, _Layer(), torch.device("cpu"), pays=None).cpu_s(1) == 5e-3  # no verdict
    assert len(measured) == 1 and len(measured[0]) == _Layer.num_experts
    assert hybrid.machine_costs(worker, _Layer(), torch.device("cpu"), True, pays).cpu_s(1) == 2e-3  # again
    assert "(again, as the last calibration gave it no share; --cpu-experts off skips it)" in capsys.readouterr().err
    assert load_costs(path, key).cpu_s(1) == 2e-3 and saved_measurements(path, key) == 2
    assert hybrid.machine_costs(worker, _Layer(), torch.device("cpu"), pays=pays).cpu_s(1) == 2e-3
    assert len(measured) == 2  # the quiet reading pays: read as saved


def test_a_machine_whose_share_never_pays_is_measured_again_at_a_few_loads_only(tmp_path, monkeypatch, worker):
    monkeypatch.setenv("MIRA_CACHE", str(tmp_path / "stores"))
    readings = iter([_cpu_ms(4.0), _cpu_ms(6.0), _cpu_ms(5.0)])
    monkeypatch.setattr(hybrid, "calibrate", lambda worker, blobs, device: next(readings))
    never = lambda costs: False  # noqa: E731
    kept = [hybrid.machine_costs(worker, _Layer(), torch.device("cpu"), pays=never).cpu_s(1) for _ in range(5)]
    assert kept == [4e-3] * 5  # the slower readings never replace the faster
    assert saved_measurements(costs_path("cpu", hybrid.calibration_dir()), entry_key(worker)) == MEASUREMENTS == 3


def test_a_corrupt_costs_file_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "cpu-hybrid.json"
    path.write_text("{not json")
    with pytest.raises(MiraError, match="delete it"):
        load_costs(path, "key")
    path.write_text(json.dumps({"entries": {"key": {"costs": {"blob_bytes": 1}, "format": FORMAT}}}))
    with pytest.raises(MiraError, match="delete the file"):
        load_costs(path, "key")


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_calibration_measures_pcie_and_the_kernel(worker):
    layout = worker.ffn.layout
    blobs = [torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8).pin_memory() for _ in range(8)]
    costs = calibrate(worker, blobs, "cuda", cpu_budget_s=0.05)
    assert costs.pcie_bytes_per_s > 0 and costs.pcie_latency_s >= 0
    assert costs.gpu(1) > 0 and math.isfinite(costs.pcie_s(1))
    assert costs.cpu(1) > 0 and costs.cpu_call_s > 0


def test_the_host_stays_busy_until_the_workers_result_and_returns_it(worker):
    from mira.runtime.calibrate import keep_host_busy

    calls = []
    future = worker.call(lambda: time.sleep(0.05) or "done")
    assert keep_host_busy(future) == "done" and future.done()
    assert keep_host_busy(worker.call(calls.append, 1)) is None and calls == [1]
