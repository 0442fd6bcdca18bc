"""The CPU lanes' share of lagged decode calls (mira.runtime.graph_share), on the CPU: the device's
choice of misses as tensor operations, the exchange through the mailbox played by the caller.

Checked against independent references: the float64 reference FFN on the store's blobs, a choice
worked out in Python from the routing and the tables, greedy output with the share off, and counts
of host reads and new tensors (the CPU tests' stand-ins for CUDA's sync and allocation checks).
"""

from __future__ import annotations

import time

import pytest
import torch

import mira
from allocations import NewTensors
from host_reads import host_reads
from mira.errors import MiraError
from mira.kernels import DECODE_TOKENS, make_moe_ffn
from mira.runtime import engine, graph_share
from mira.runtime.experts import MiraExperts
from mira.cache.costmodel import HybridCosts, LinearCost
from mira.runtime.graph_share import CALIBRATION_REPEATS, QUOTA_STEPS, LanePrices, fastest, make_graph_share, \
    time_lanes
from mira.runtime.mailbox import Mailbox
from mira.store.convert import convert
from tiny_models import mixtral_layer_call, mixtral_layer_reference

E, K = 8, 2  # the tiny Mixtral: top-2 of 8 experts
GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)


def _layers(model) -> list[MiraExperts]:
    return sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)), key=lambda m: m.layer_position)


def _budget(store, slots: int) -> int:
    probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
    return probe.plan.reserve_bytes + slots * probe.store.blob_bytes


def _load(store, slots: int = 9, **settings):
    settings = {"prefetch": "off", "residency": "lagged", **settings}
    return mira.load(store, device="cpu", vram_budget=_budget(store, slots), progress=False, **settings)


def _expected_choice(model, layer: int, index: torch.Tensor, quota: int) -> set[int]:
    """The first `quota` routed experts, in expert order, whose table entry is their host blob."""
    tables = model.cache.tables
    misses = [e for e in sorted(set(index.reshape(-1).tolist()))
              if tables.tables[layer, e].item() == tables.blob_addresses[layer * E + e].item()]
    return set(misses[:quota])


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_lanes_compute_the_first_misses_and_the_layer_matches_the_float64_reference(mixtral_store, tokens):
    model = _load(mixtral_store, cpu_experts="graph", cpu_threads=2)
    share = model.graph_share
    assert share.quotas == [K] * 3  # on the CPU nothing crosses PCIe: the lanes may take every miss
    share.quotas = [1] * 3  # one miss a call, so the kernel computes the other
    computed, tokens_computed = [], []
    for step in range(4):
        for layer in _layers(model):
            p = layer.layer_position
            args = mixtral_layer_call(p + 10 * step, tokens)
            expected = mixtral_layer_reference(model.store, p, *args)
            chosen = _expected_choice(model, p, args[1], 1)
            served = sum(share.lanes.served) if share.lanes is not None else 0
            got = layer(*args)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
            assert set(torch.nonzero(share._chosen).reshape(-1).tolist()) == chosen
            assert sum(share.lanes.served) - served == len(chosen)
            computed.append(len(chosen))
            tokens_computed.append(sum(e in chosen for e in args[1].reshape(-1).tolist()))
        model.cache.settle()
        model.cache.end_step(tokens)
    cpu = model.stats()["cpu_experts"]
    assert sum(computed) > 0 and cpu["experts"] == sum(computed)
    assert cpu["tokens"] == sum(tokens_computed)


def test_on_the_fused_kernels_a_decode_call_reads_nothing_back_and_allocates_nothing(mixtral_store, monkeypatch):
    monkeypatch.setattr(engine, "make_moe_ffn", lambda *args, **kwargs: make_moe_ffn(*args, **kwargs, backend="triton"))
    model = _load(mixtral_store, cpu_experts="graph", cpu_threads=2, cpu_lanes=2)
    monkeypatch.undo()
    layers, share = _layers(model), model.graph_share
    assert all(hasattr(layer.ffn, "forward_bases") for layer in layers)
    for step in range(3):
        for layer in layers:
            p = layer.layer_position
            args = mixtral_layer_call(p + 10 * step, 1)
            chosen = _expected_choice(model, p, args[1], K)
            if step:  # the first call made the mailbox and the lanes
                reads, new = host_reads(monkeypatch, this_thread=True), NewTensors()  # the lanes read theirs
                with new:
                    bases = share.post(p, *args)
                monkeypatch.undo()
                assert reads == [] and new.ops == []  # the choice and the hand-over: no read-back, no allocation
                assert [e for e in range(E) if bases[e] == 0] == sorted(chosen)
                assert all(bases[e] == model.cache.tables.tables[p, e] for e in range(E) if e not in chosen)
                share.collect(torch.zeros(1, args[0].shape[1]))  # the lanes' sums of that hand-over, not needed
            got = layer(*args)
            expected = mixtral_layer_reference(model.store, p, *args)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        model.cache.settle()
        model.cache.end_step(1)
    assert model.stats()["cpu_experts"]["experts"] > 0


@pytest.mark.parametrize("lanes", [1, 2])
def test_greedy_output_is_the_same_with_the_share_on_and_off(mixtral_store, lanes):
    prompt = torch.randint(2, 320, (1, 12), generator=torch.Generator().manual_seed(7))
    off = _load(mixtral_store, cpu_experts="off").generate(prompt, **GREEDY)
    model = _load(mixtral_store, cpu_experts="graph", cpu_threads=2, cpu_lanes=lanes)
    assert torch.equal(model.generate(prompt, **GREEDY), off)
    stats = model.stats()
    assert stats["residency"] == "lagged" and stats["cpu_experts"]["mode"] == "graph"
    assert stats["cpu_experts"]["lanes"] == lanes and stats["cpu_experts"]["experts"] > 0


def test_int4_experts_through_the_lanes_generate_the_text_of_the_share_off(int4_checkpoints, tmp_path):
    store = tmp_path / "int4"
    convert(int4_checkpoints["mixtral"], store, "int4", progress=False)
    prompt = torch.randint(2, 320, (1, 12), generator=torch.Generator().manual_seed(7))
    off = _load(store, cpu_experts="off").generate(prompt, **GREEDY)
    model = _load(store, cpu_experts="graph", cpu_threads=2, cpu_lanes=2)
    assert torch.equal(model.generate(prompt, **GREEDY), off)
    assert model.stats()["cpu_experts"]["experts"] > 0


def test_a_lane_that_fails_raises_on_the_callers_thread_and_the_next_call_runs(mixtral_store):
    model = _load(mixtral_store, cpu_experts="graph", cpu_threads=2, cpu_lanes=2)
    layer = _layers(model)[0]
    args = mixtral_layer_call(1, 1)
    layer(*args)  # makes the lanes
    lanes = model.graph_share.lanes
    blobs, lanes._blobs = lanes._blobs, [[None] * E for _ in lanes._blobs]  # every expert without a blob
    with pytest.raises(RuntimeError, match="CPU lane failed"):
        for step in range(4):  # until a call gives the lanes a miss
            layer(*mixtral_layer_call(2 + step, 1))
    lanes._blobs = blobs
    got = layer(*args)
    torch.testing.assert_close(got.double(), mixtral_layer_reference(model.store, 0, *args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_each_call_exchanges_contiguous_blocks_as_the_device_copies_need(lanes):
    # A graph captures no copy from a strided pinned view, and eagerly torch gathers one on the host
    # when the copy is enqueued, before the lanes have written it.
    box = Mailbox(lanes, 8, 2, torch.bfloat16, torch.float32, torch.device("cpu"))
    for T in range(1, DECODE_TOKENS + 1):
        assert box.out[:T].shape == (T, lanes, 8)  # token-major: a call's sums are its first T rows
        assert all(buffer[:T].is_contiguous() for buffer in (box.rows, box.ids, box.weights, box.out))


def test_the_share_is_refused_where_it_cannot_run(mixtral_store):
    with pytest.raises(MiraError, match="--residency lagged"):
        _load(mixtral_store, cpu_experts="graph", residency="inline")
    with pytest.raises(MiraError, match="--cpu-lanes 3 needs at least as many CPU threads"):
        _load(mixtral_store, cpu_experts="graph", cpu_threads=2, cpu_lanes=3)
    with pytest.raises(MiraError, match="--cpu-lanes 0"):
        _load(mixtral_store, cpu_experts="graph", cpu_lanes=0)


def test_the_lanes_time_their_experts_through_real_exchanges(mixtral_store):
    model = _load(mixtral_store, cpu_experts="graph", cpu_threads=2, cpu_lanes=2)
    _layers(model)[0](*mixtral_layer_call(1, 1))  # makes the lanes
    lanes = model.graph_share.lanes
    served = lanes.served[0]
    _, call_s = time_lanes(lanes, [model.store.blob(0, e) for e in range(E)], torch.device("cpu"))
    assert call_s > 0  # the tiny experts' own time is lost in this machine's noise; the round trip is not
    assert lanes.served[0] - served == (CALIBRATION_REPEATS + 1) * (2 + 4)  # jobs of 0, 2 and 4 experts, each computed


def test_the_fastest_lane_count_is_kept():
    # Both experts of a layer always miss; a miss crosses PCIe in 3.3 ms, an exchange takes 0.1 ms.
    # One lane computes an expert in 2.8 ms: quota 1 gives max(2.9, 3.3) = 3.3 ms, quota 2 5.7 ms.
    # Two lanes take 4.0 ms an expert beside each other: 4.1 ms at quota 1 or 2. One lane is faster.
    one, two = (LanePrices(top_k=2, lanes=n, expert_s=s, call_s=1e-4, pcie_s=3.3e-3) for n, s in ((1, 2.8e-3),
                                                                                                   (2, 4.0e-3)))
    assert one.layer_s(1.0) == pytest.approx(3.3e-3) and two.layer_s(1.0) == pytest.approx(4.1e-3)
    assert fastest([one, two], 1.0) is one
    # Small experts: 0.6 ms on one lane, 0.4 on each of two, 1.0 ms over PCIe. One lane: quota 1 gives
    # max(0.7, 1.0) = 1.0, quota 2 1.3; two lanes: quota 2 gives 0.5. Two lanes are faster.
    one, two = (LanePrices(top_k=2, lanes=n, expert_s=s, call_s=0.1, pcie_s=1.0) for n, s in ((1, 0.6), (2, 0.4)))
    assert fastest([one, two], 1.0) is two and two.quota(1.0) == 2
    # a tie goes to fewer lanes
    assert fastest([LanePrices(2, 2, 0.4, 0.1, 1.0), LanePrices(2, 1, 0.4, 0.1, 1.0)], 0.0).lanes == 1


def test_load_times_each_lane_count_and_keeps_the_fastest(mixtral_store, monkeypatch):
    model = _load(mixtral_store, cpu_experts="off")
    costs = HybridCosts(blob_bytes=model.store.blob_bytes, cpu=LinearCost(1.0, 0.0), cpu_call_s=0.0,
                        pcie_bytes_per_s=model.store.blob_bytes / 1.0)  # a miss crosses PCIe in 1 s
    timed = []

    def priced(lanes, blobs, device):  # the small experts' prices above, by the lanes' count
        timed.append((lanes.mailbox.lanes, lanes.threads))
        return {1: (0.6, 0.1), 2: (0.4, 0.1)}[lanes.mailbox.lanes]

    monkeypatch.setattr(graph_share, "time_lanes", priced)

    def made(**given):
        return make_graph_share(model.store, model.cache.tables, torch.nn.functional.silu, None, costs, K, 1.0,
                                torch.float32, torch.device("cpu"), **given)

    share = made(threads=2)
    assert timed == [(1, 2), (2, 1)]  # one lane of both threads, then two of one each
    assert share.prices.lanes == 2 and share.quotas == [2] * 3 and share.lanes is None  # made by the first call
    assert share.summary()["timed_lanes_us"] == {1: dict(expert_s=6e5, call_s=1e5, pcie_s=1e6),
                                                 2: dict(expert_s=4e5, call_s=1e5, pcie_s=1e6)}
    timed.clear()
    share = made(threads=1)  # two lanes need two threads: one lane alone is timed
    assert timed == [(1, 1)] and share.prices.lanes == 1 and share.quotas == [1] * 3
    timed.clear()
    share = made(threads=2, lanes=1)  # as asked
    assert timed == [(1, 2)] and share.prices.lanes == 1


class _HeldBox:
    """A CUDA mailbox as the watchdog sees it: its device, and the host's release of the held stream."""

    device = torch.device("cuda")

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_an_exchange_the_lanes_never_answer_is_released_and_refused(monkeypatch):
    monkeypatch.setattr(graph_share, "ANSWER_S", 0.05)
    answered, held = _HeldBox(), _HeldBox()
    with graph_share._watched(answered):
        pass  # the stream is through at once
    time.sleep(0.1)
    assert answered.released == 0
    deadline = time.perf_counter() + 5
    with pytest.raises(MiraError, match="did not answer"), graph_share._watched(held):
        while not held.released and time.perf_counter() < deadline:  # a synchronize, held until DONE is raised
            time.sleep(0.001)
    assert held.released == 1


# a layer that always misses gives the lanes both its experts (1.1 s against 1.5 for one, 3.0 for none);
# one that never misses gives them none (each exchange would cost 0.1 s for nothing)
PRICES = LanePrices(top_k=K, lanes=2, expert_s=1.0, call_s=0.1, pcie_s=1.5)


def test_requote_prices_each_layer_at_its_own_miss_rate(mixtral_store):
    share = _load(mixtral_store, cpu_experts="graph", cpu_threads=2).graph_share
    assert share.prices is None and not share.requote([1.0, 1.0, 1.0])  # nothing crosses PCIe on the CPU
    share.prices = PRICES
    assert share.requote([1.0, 0.0, 1.0]) and share.quotas == [2, 0, 2]
    assert not share.requote([1.0, 0.0, 1.0]) and share.requotes == 1


def test_every_quota_steps_the_quotas_follow_the_miss_rates_decoding_saw(mixtral_store):
    model = _load(mixtral_store, cpu_experts="graph", cpu_threads=2, policy="on-demand")  # every routed expert misses
    share = model.graph_share
    share.prices, share.quotas = PRICES, [0, 0, 0]
    prompt = torch.randint(2, 320, (1, 24), generator=torch.Generator().manual_seed(7))  # a prefill, not a decode call
    steps = dict(do_sample=False, pad_token_id=0)
    model.generate(prompt, max_new_tokens=QUOTA_STEPS, min_new_tokens=QUOTA_STEPS, **steps)  # a decode step short
    assert share.quotas == [0, 0, 0] and share.lanes is None  # no layer took part yet
    model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **steps)
    assert share.quotas == [2, 2, 2] and share.requotes == 1
