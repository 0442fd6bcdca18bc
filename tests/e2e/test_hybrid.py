"""Missed experts computed on the CPU worker while the layer's kernel computes the rest
(mira.runtime.hybrid), on the CPU: the "device side" is the reference FFN, the same steps run.

Checked against independent references: the float64 reference FFN on the store's blobs, the
routing the layer was given (which experts miss, which tokens), a hand-worked split, and greedy
output with the CPU's share switched off.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import mira
from mira.cache.costmodel import KEEP_LAYER_S, CpuPace, HybridCosts, LinearCost
from mira.runtime import engine
from mira.runtime.config import RuntimeConfig
from mira.runtime.cpu_worker import CpuExpertWorker
from mira.runtime.experts import MiraExperts
from mira.runtime.hybrid import CpuExperts, HybridExperts
from tiny_models import mixtral_layer_call, mixtral_layer_reference

E, K, H = 8, 2, 64  # the tiny Mixtral: top-2 of 8 experts, hidden 64
PROMPT = "Write a short poem about the sea."  # bf16 products for the CPU's share change this reply's tokens


def _layers(model) -> list[MiraExperts]:
    return sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)), key=lambda m: m.layer_position)


def _on_demand(store, cpu_experts: str):
    """Every routed expert misses (on-demand never admits) and is read from its host blob."""
    probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
    budget = probe.plan.reserve_bytes + E * probe.store.blob_bytes  # the least: one layer
    return mira.load(store, device="cpu", vram_budget=budget, policy="on-demand", prefetch="off",
                     cpu_experts=cpu_experts, progress=False)


class _Spy:
    """Wraps a layer's FFN: records, per call, which routed experts it found without a blob, and the
    units each expert was limited to (None: no limits passed)."""

    def __init__(self, ffn):
        self.ffn, self.absent, self.limits = ffn, [], []

    def __call__(self, hidden, top_k_index, top_k_weights, blobs, **options):
        routed = top_k_index.unique().tolist()
        self.absent.append({e for e in routed if blobs[e] is None})
        limits = options.get("limits")
        self.limits.append(None if limits is None else limits.tolist())
        return self.ffn(hidden, top_k_index, top_k_weights, blobs, **options)


@pytest.mark.parametrize("tokens", [1, 3, 20])  # decode calls, and a prefill call beyond the decode buffers
def test_with_all_the_worker_computes_every_miss_and_the_kernel_sees_them_absent(mixtral_store, tokens):
    model = _on_demand(mixtral_store, "all")
    assert model.stats()["residency"] == "inline"  # on-demand lags on the CPU, unless the CPU takes misses
    jobs = []
    submit = model.hybrid.worker.submit
    model.hybrid.worker.submit = lambda job: jobs.append(list(job.experts)) or submit(job)
    entries = model.cache.tables.tables.clone()
    for layer in _layers(model):
        layer.ffn = spy = _Spy(layer.ffn)
        args = mixtral_layer_call(layer.layer_position + 10 * tokens, tokens)
        routed = sorted(args[1].unique().tolist())
        got = layer(*args)
        expected = mixtral_layer_reference(model.store, layer.layer_position, *args)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        assert jobs[-1] == routed and spy.absent == [set(routed)]  # every miss on the CPU, none in the kernel
        assert all(blob is not None for blob in model.cache.tables.rows[layer.layer_position])  # restored
    assert torch.equal(model.cache.tables.tables, entries)
    cpu = model.stats()["cpu_experts"]
    assert cpu["calls"] == len(jobs) == 3 and cpu["tokens"] == 3 * tokens * K
    assert cpu["experts"] == sum(len(j) for j in jobs)
    assert model.stats()["cache"]["tokens_served"]["miss"] == 3 * tokens * K  # a miss for the policy too


def test_a_decode_calls_rows_reach_the_host_before_its_settle_and_a_prefill_calls_after(mixtral_store):
    """On CUDA a settle makes the stream wait for the copies of the experts it admits; a decode
    call's rows, which the CPU's job reads, are copied to the host before that, so the job need not
    wait for those copies. A larger call's rows are copied only when it makes a job, after its
    settle. Checked where the settle starts, on the host buffers the job then reads."""
    model = _on_demand(mixtral_store, "all")
    layer = _layers(model)[0]
    at_settle = []
    settle = model.cache.settle_layer

    def spying(layer_position):
        rows = model.hybrid._rows
        at_settle.append(None if rows is None else rows.hidden.clone())
        return settle(layer_position)

    model.cache.settle_layer = spying
    decode, prefill = mixtral_layer_call(1, 3), mixtral_layer_call(2, 20)
    for args in (decode, prefill):
        layer(*args)
    assert torch.equal(at_settle[0][:3], decode[0])
    assert at_settle[1].shape[0] < 20 and torch.equal(at_settle[1][:3], decode[0])  # still the decode call's
    assert torch.equal(model.hybrid._rows.hidden[:20], prefill[0])  # copied for its job


def test_a_split_sends_the_cost_models_share_to_the_worker_and_the_rest_to_the_kernel(mixtral_store):
    model = _on_demand(mixtral_store, "all")
    blob = model.store.blob_bytes
    # one miss costs 1 ms on either side, nothing per call: of n misses the CPU takes floor(n / 2)
    # (a tie goes to the fewer CPU experts), the lowest ids (the split lists experts ascending)
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(1e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    hybrid = HybridExperts(model.hybrid.worker, model.store, model.cache.tables, costs, True, torch.device("cpu"))
    layer = _layers(model)[1]
    layer.hybrid, layer.ffn = hybrid, _Spy(layer.ffn)
    jobs = []
    submit = hybrid.worker.submit
    hybrid.worker.submit = lambda job: jobs.append(list(job.experts)) or submit(job)
    predicted = []  # ms per call: (the later side, the CPU's side)
    for seed, tokens in ((1, 1), (2, 2), (3, 3)):
        args = mixtral_layer_call(seed, tokens)
        routed = sorted(args[1].unique().tolist())
        cpu = routed[: len(routed) // 2]
        predicted.append((len(routed) - len(cpu), len(cpu)))
        got = layer(*args)
        expected = mixtral_layer_reference(model.store, 1, *args)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        assert jobs[-1] == cpu and layer.ffn.absent[-1] == set(cpu)
    layer_times = hybrid.summary()["layers"]
    assert [row["layer"] for row in layer_times] == [1] and layer_times[0]["calls"] == 3
    assert layer_times[0]["predicted_ms"] == pytest.approx(sum(p for p, _ in predicted) / 3, abs=1e-3)
    assert layer_times[0]["predicted_cpu_ms"] == pytest.approx(sum(c for _, c in predicted) / 3, abs=1e-3)
    assert layer_times[0]["measured_ms"] > 0


def test_a_one_token_call_cuts_a_miss_between_the_worker_and_the_kernel(mixtral_store):
    """Hand-worked: a CPU at 2 ms per expert, PCIe at 1 ms, 6 parts of 16 units (I = 96), the CPU
    reading w2's share c2 of the blob whatever its part. Whole, both misses go over PCIe: 2 ms. Cut
    at j of 6 parts on the CPU, the other miss whole on PCIe: 2 (c2 + (1 - c2) j / 6) on the CPU
    against 1 + (1 - j / 6); at j = 3, 1.33 against 1.5 ms (j = 4: 1.55 against 1.33). So the lower
    expert's units from 48 on go to the worker, the kernel computes it below 48, and the other
    whole; after the call its limit is whole again, and whole experts' pace learnt nothing from
    the cut's part. Calls of more tokens never cut."""
    model = _on_demand(mixtral_store, "all")
    store = model.store
    blob = store.blob_bytes
    c2 = store.layout.sections["w2"].nbytes / store.layout.nbytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(2e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    hybrid = HybridExperts(model.hybrid.worker, store, model.cache.tables, costs, True, torch.device("cpu"),
                           CpuPace(learn=0.5), cut_granule=16)
    assert hybrid.cuts.parts == 6 and 2 * (c2 + (1 - c2) / 2) < 1.5 < 2 * (c2 + (1 - c2) * 4 / 6)
    layer = _layers(model)[1]
    layer.hybrid, layer.ffn = hybrid, _Spy(layer.ffn)
    jobs = []
    submit = hybrid.worker.submit
    hybrid.worker.submit = lambda job: jobs.append((list(job.experts), job.cut)) or submit(job)
    args = mixtral_layer_call(5, 1)
    low, high = sorted(args[1].unique().tolist())
    got = layer(*args)
    torch.testing.assert_close(got.double(), mixtral_layer_reference(store, 1, *args), rtol=1e-5, atol=1e-5)
    assert jobs == [([low], (low, 48))] and layer.ffn.absent == [set()]
    assert layer.ffn.limits == [[48 if e == low else 96 for e in range(E)]]
    assert model.cache.tables.limits.eq(96).all()
    summary = hybrid.summary()
    assert summary["cuts"] == 1 and summary["cut_share"] == 0.5 and summary["experts"] == 0  # units 48-95 of 96
    assert summary["layers"][0]["predicted_ms"] == pytest.approx(1.5, abs=1e-3) and hybrid.pace.scale == 1.0
    args = mixtral_layer_call(6, 3)
    torch.testing.assert_close(layer(*args).double(), mixtral_layer_reference(store, 1, *args), rtol=1e-5, atol=1e-5)
    assert jobs[-1][1] is None and layer.ffn.limits[-1] is None


def test_a_cut_teaches_the_cut_pace_and_pulls_whole_experts_pace_back(mixtral_store):
    """The costs of the cut test above, with whole experts' pace at 3 (a CPU at 6 ms per expert):
    the cut (priced by its own pace, at 1) still wins, its job sets the cut pace to its measured
    CPU side over the calibrated 1.33 ms (learning weight 1), and the layer, which gave whole
    experts no job, halves whole experts' log pace (forgetting weight 1/2): sqrt(3)."""
    model = _on_demand(mixtral_store, "all")
    store = model.store
    blob = store.blob_bytes
    c2 = store.layout.sections["w2"].nbytes / store.layout.nbytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(2e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    pace = CpuPace(learn=1.0, forget=0.5)
    hybrid = HybridExperts(model.hybrid.worker, store, model.cache.tables, costs, True, torch.device("cpu"),
                           pace, cut_granule=16)
    pace.observe(3.0, 1.0)
    assert hybrid.cut_pace.scale == 1.0 and (hybrid.cut_pace.learn, hybrid.cut_pace.forget) == (1.0, 0.5)
    layer = _layers(model)[1]
    layer.hybrid = hybrid
    args = mixtral_layer_call(5, 1)
    torch.testing.assert_close(layer(*args).double(), mixtral_layer_reference(store, 1, *args), rtol=1e-5, atol=1e-5)
    hybrid.collect()
    calibrated = 2e-3 * (c2 + (1 - c2) / 2)
    assert hybrid.telemetry.cuts[1] == 1
    assert hybrid.cut_pace.scale == pytest.approx(hybrid.telemetry.measured_s[1] / calibrated, rel=1e-9)
    assert hybrid.pace.scale == pytest.approx(math.sqrt(3), rel=1e-9)
    summary = hybrid.summary()
    assert (summary["cpu_pace"], summary["cpu_cut_pace"]) == (round(hybrid.pace.scale, 4),
                                                             round(hybrid.cut_pace.scale, 4))
    (job,) = summary["jobs"]  # the cut, half the units: what the cut pace learnt from
    assert (job["whole_experts"], job["cut_share"], job["jobs"]) == ("0", "0.4-0.6", 1)
    assert job["calibrated_ms"] == pytest.approx(1e3 * calibrated, abs=1e-4)
    assert job["measured_over_calibrated"] == pytest.approx(hybrid.cut_pace.scale, abs=1e-4)


def test_the_cpus_side_is_priced_at_the_pace_decoding_measures(mixtral_store):
    """Costs that put one expert at a full second on the CPU: each finished decode job pulls the
    pace towards its measured CPU side over the calibrated one, and later predictions with it."""
    model = _on_demand(mixtral_store, "all")
    costs = HybridCosts(blob_bytes=model.store.blob_bytes, cpu=LinearCost(1.0, 0.0), cpu_call_s=0.0,
                        pcie_bytes_per_s=None)
    hybrid = HybridExperts(model.hybrid.worker, model.store, model.cache.tables, costs, False, torch.device("cpu"),
                           CpuPace(learn=0.5))
    layer = _layers(model)[0]
    layer.hybrid = hybrid
    assert hybrid.choose([], [(0, 1)]).cpu_s == pytest.approx(1.0)
    ratios = []  # per job: measured seconds of the CPU's side over the calibrated ones (1 s per expert)
    telemetry = hybrid.telemetry
    for seed in range(4):
        measured, experts = telemetry.measured_s[0], telemetry.experts[0]
        layer(*mixtral_layer_call(seed, 1))
        hybrid.collect()
        ratios.append((telemetry.measured_s[0] - measured) / (telemetry.experts[0] - experts))
    expected = math.exp(sum(0.5 ** (len(ratios) - i) * math.log(r) for i, r in enumerate(ratios)))
    assert hybrid.pace.scale == pytest.approx(expected, rel=1e-9) and hybrid.pace.scale < 0.1
    assert hybrid.choose([], [(0, 1)]).cpu_s == pytest.approx(hybrid.pace.scale)
    assert hybrid.summary()["cpu_pace"] == round(hybrid.pace.scale, 4)


class _DeviceClock(HybridExperts):
    """Times the device's side at a fixed number of seconds, as CUDA events would on a GPU."""

    device_s = 4e-3

    def _device_seconds(self) -> float:
        return self.device_s


def test_the_devices_side_is_priced_at_the_pace_its_timing_measures(mixtral_store):
    """Hand-worked, the CPU's side held at its calibration: two decode misses, the CPU at 1.5 ms
    each, PCIe at 1 ms: one miss each side (1.5 ms; both on PCIe take 2). The device's side,
    predicted at 1 ms, takes 4: with learning weight 1 its pace is 4, so the next layer gives the
    CPU both misses (3 ms; one over PCIe would end at 4), and that layer, which gave the device
    none, halves its log pace (forgetting 1/2): 2."""
    model = _on_demand(mixtral_store, "all")
    blob = model.store.blob_bytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(1.5e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    hybrid = _DeviceClock(model.hybrid.worker, model.store, model.cache.tables, costs, True, torch.device("cpu"),
                          CpuPace(learn=1.0, forget=0.5))
    assert (hybrid.device_pace.learn, hybrid.device_pace.forget) == (1.0, 0.5)
    hybrid.pace.learn = hybrid.cut_pace.learn = 0.0  # the CPU's side held at its calibration
    layer = _layers(model)[1]
    layer.hybrid, layer.ffn = hybrid, _Spy(layer.ffn)
    for seed, cpu_experts in ((5, 1), (6, 2)):
        args = mixtral_layer_call(seed, 1)
        torch.testing.assert_close(layer(*args).double(), mixtral_layer_reference(model.store, 1, *args),
                                   rtol=1e-5, atol=1e-5)
        assert len(layer.ffn.absent[-1]) == cpu_experts
        if cpu_experts == 1:
            hybrid.collect()
            assert hybrid.device_pace.scale == pytest.approx(4.0)
            assert hybrid.choose([], [(0, 1), (1, 1)]).cpu == [0, 1]
    hybrid.collect()
    assert hybrid.device_pace.scale == pytest.approx(2.0) and hybrid.summary()["device_pace"] == 2.0
    assert hybrid.telemetry.summary()["layers"][0]["device_ms"] == pytest.approx(4.0)


def test_without_the_device_pace_the_devices_side_stays_at_its_calibration(mixtral_store):
    """The costs of the test above with `device_pace` off (the bench's mira-device-calibrated): the
    same 4 ms device side teaches nothing, and the next layer is split one miss each side again."""
    model = _on_demand(mixtral_store, "all")
    assert RuntimeConfig().with_overrides(device_pace=False).hybrid.device_pace is False
    blob = model.store.blob_bytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(1.5e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    hybrid = _DeviceClock(model.hybrid.worker, model.store, model.cache.tables, costs, True, torch.device("cpu"),
                          CpuPace(learn=0.0), device_pace=False)
    layer = _layers(model)[1]
    layer.hybrid = hybrid
    layer(*mixtral_layer_call(5, 1))
    hybrid.collect()
    assert hybrid.device_pace is None and "device_pace" not in hybrid.summary()
    split = hybrid.choose([], [(0, 1), (1, 1)])
    assert (split.cpu, split.pcie, split.gpu_s) == ([0], [1], pytest.approx(1e-3))


def test_an_admissions_copy_comes_first_on_the_devices_side(mixtral_store):
    """Hand-worked, the CPU at 1.5 ms an expert, PCIe at 1 ms a blob, kernels free: a lone miss goes
    over PCIe (1 ms). Beside an expert admitted in the same settle, whose copy takes PCIe's first
    millisecond, it would end at 2 ms there: it goes to the CPU (1.5 ms), and the device's side is
    the copy."""
    model = _on_demand(mixtral_store, "all")
    blob = model.store.blob_bytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(1.5e-3, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 1e-3)
    hybrid = HybridExperts(model.hybrid.worker, model.store, model.cache.tables, costs, True, torch.device("cpu"),
                           CpuPace(learn=0.0), device_pace=False)
    alone = hybrid.choose([(2, 1)], [(0, 1)])
    assert (alone.cpu, alone.pcie, alone.gpu_s) == ([], [0], pytest.approx(1e-3))
    beside = hybrid.choose([(2, 1)], [(0, 1)], copied=[(2, 1)])
    assert (beside.cpu, beside.pcie, beside.cpu_s, beside.gpu_s) == ([0], [], pytest.approx(1.5e-3),
                                                                     pytest.approx(1e-3))


def test_a_kernel_that_fails_after_the_cpus_share_began_leaves_the_layer_whole(mixtral_store):
    """The error reaches the caller; the experts hidden for the CPU are back in the table, the
    worker's job is over, and the layer's next call is right and is the only one recorded."""
    model = _on_demand(mixtral_store, "all")
    layer = _layers(model)[0]
    entries = model.cache.tables.tables.clone()
    kernel, jobs = layer.ffn, []
    submit = model.hybrid.worker.submit
    model.hybrid.worker.submit = lambda job: jobs.append(submit(job)) or jobs[-1]

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("the kernel's workspace")

    layer.ffn = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        layer(*mixtral_layer_call(0, 3))
    assert len(jobs) == 1 and jobs[0].done()
    assert torch.equal(model.cache.tables.tables, entries)
    assert all(blob is not None for blob in model.cache.tables.rows[0])
    layer.ffn = kernel
    args = mixtral_layer_call(1, 3)
    torch.testing.assert_close(layer(*args).double(), mixtral_layer_reference(model.store, 0, *args),
                               rtol=1e-5, atol=1e-5)
    assert model.stats()["cpu_experts"]["calls"] == 1


@pytest.mark.parametrize("quant", ["int8-shared", "int4"])
def test_greedy_output_is_the_same_with_the_cpu_share_off_all_and_auto(quant):
    """The bundled model under a budget that makes misses happen; auto on the CPU stays off."""
    replies, stats = {}, {}
    for mode in ("off", "all", "auto"):
        model = mira.load(None, device="cpu", vram_budget="25%", quant=quant, cpu_experts=mode, progress=False)
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"]
        replies[mode] = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        stats[mode] = model.stats()
    assert len(replies["off"]) == 48 and replies["off"] == replies["all"] == replies["auto"]
    assert stats["off"]["cpu_experts"] == {"mode": "off"} and stats["auto"]["cpu_experts"] == {"mode": "off"}
    cpu = stats["all"]["cpu_experts"]
    misses = stats["all"]["cache"]["lookups"]["miss"]
    assert 0 < cpu["experts"] <= misses and cpu["tokens"] > 0  # admitted misses stay with the kernel
    assert stats["all"]["cache"]["lookups"] == stats["off"]["cache"]["lookups"]  # the policy saw the same


@pytest.mark.parametrize("cpu_s, kept", [(1.0, False), (1e-6, True)])
def test_autos_share_is_judged_in_its_first_decode_steps_and_dropped_where_it_does_not_pay(cpu_s, kept):
    """The bundled model with every miss on the CPU, its share priced at fixed paces (learning off)
    with a miss 10 ms over PCIe. At 1 s an expert on the CPU no split gives the CPU a miss, which
    saves exactly nothing: judged so REVIEW_CHECKS times, every REVIEW_STEPS decode steps, the share
    is dropped: layers lag, the worker stops and computes nothing more. At 1 us an expert the share
    saves about 10 ms per expected miss and is kept at the first judgement. Greedy output is that
    of the CPU's share off either way."""
    prompt = {"role": "user", "content": PROMPT}
    off = mira.load(None, device="cpu", vram_budget="25%", cpu_experts="off", progress=False)
    ids = off.tokenizer.apply_chat_template([prompt], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    assert ids.shape[1] > engine.DECODE_TOKENS  # the prefill is no decode step
    steps = engine.REVIEW_STEPS * engine.REVIEW_CHECKS  # the last judgement falls inside the first call
    expected = [off.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
                for n in (steps + 8, 16)]

    model = mira.load(None, device="cpu", vram_budget="25%", cpu_experts="all", progress=False)
    blob = model.store.blob_bytes
    costs = HybridCosts(blob_bytes=blob, cpu=LinearCost(cpu_s, 0.0), cpu_call_s=0.0, pcie_bytes_per_s=blob / 10e-3)
    loaded = model.hybrid  # kept: collected, it would close the worker the two share
    hybrid = HybridExperts(loaded.worker, model.store, model.cache.tables, costs, False, torch.device("cpu"),
                           CpuPace(learn=0.0, forget=0.0), device_pace=False)
    model.hybrid = hybrid
    for layer in _layers(model):
        layer.hybrid = hybrid
    model._review_in = engine.REVIEW_STEPS  # as `mira.load` sets it for auto's share on CUDA

    first = model.generate(ids, max_new_tokens=steps + 8, do_sample=False)[0, ids.shape[1]:].tolist()
    calls = sum(hybrid.telemetry.calls)
    second = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert [first, second] == expected
    stats = model.stats()
    review = stats["cpu_experts"]["review"]
    if kept:
        assert (review["after_decode_steps"], review["kept"]) == (engine.REVIEW_STEPS, True)
        assert KEEP_LAYER_S * 1e3 < review["paced_saving_ms"] <= 20.0  # 20 ms x the decode miss rate
        assert stats["residency"] == "inline" and sum(hybrid.telemetry.calls) > calls
        assert all(layer.hybrid is hybrid for layer in _layers(model))
    else:
        assert (review["after_decode_steps"], review["kept"]) == (steps, False)
        judgement = {"paced_saving_ms": 0.0, "cpu_pace": 1.0, "cpu_cut_pace": 1.0}  # no device pace: switched off
        assert review["judged"] == [judgement] * engine.REVIEW_CHECKS
        assert review["paced_saving_ms"] == 0.0 and review["cpu_pace"] == 1.0  # the last judgement's
        assert stats["residency"] == "lagged" and sum(hybrid.telemetry.calls) == calls
        assert all(layer.lagged and layer.hybrid is None for layer in _layers(model))
        assert not hybrid.worker._thread.is_alive()
        with pytest.raises(mira.MiraError, match="no CPU share"):
            off.drop_cpu_share()


def test_the_calibration_is_reported_whether_or_not_it_turned_the_cpu_share_on(monkeypatch):
    """A result says what the CPU and PCIe were measured at, also where auto stayed off (here: no
    GPU), so a run without a CPU share can be told apart from one whose CPU was found too slow."""
    costs = HybridCosts(blob_bytes=1 << 20, cpu=LinearCost(2e-3, 1e-4), cpu_call_s=3e-4, pcie_bytes_per_s=5e10)
    workers = []

    def calibrated(config, store, act, gate, device, misses, top_k, share_pays):
        workers.append(CpuExpertWorker(CpuExperts(store.layout, act, gate), 1))
        return workers[-1], costs

    monkeypatch.setattr(engine, "_calibrated_worker", calibrated)
    model = mira.load(None, device="cpu", vram_budget="25%", cpu_experts="auto", progress=False)
    assert model.stats()["cpu_experts"] == {"mode": "off", "calibration": costs.to_json()}
    assert not workers[0]._thread.is_alive()  # the unused worker was closed


def test_the_command_line_generates_the_same_text_with_every_miss_on_the_cpu(tmp_path):
    texts, reports = {}, {}
    for mode in ("off", "all"):
        stats = tmp_path / f"{mode}.json"
        args = ["generate", "--device", "cpu", "--temperature", "0", "--max-new-tokens", "48", "--vram-budget", "25%",
                "--prompt", PROMPT, "--quiet", "--cpu-experts", mode, "--stats-json", str(stats)]
        run = subprocess.run([sys.executable, "-m", "mira.cli", *args, *(["--cpu-threads", "2"] if mode == "all" else [])],
                             capture_output=True, text=True, timeout=300)  # the session's store cache
        assert run.returncode == 0, run.stderr
        texts[mode], reports[mode] = run.stdout, json.loads(stats.read_text())
    assert texts["off"].strip() and texts["off"] == texts["all"]
    assert reports["off"]["cpu_experts"] == {"mode": "off"}
    cpu = reports["all"]["cpu_experts"]
    assert cpu["mode"] == "all" and cpu["threads"] == 2 and cpu["tokens"] > 0
