"""Lagged residency (mira.cache.tables): decode layers under a budget count their routing on the
device and compute from address tables; the cache settles the counts with the policy once per step.

Checked against independent references: generation with every expert resident and transformers'
own model, the float64 reference FFN on the store's blobs, the slot map the cache keeps, a
brute-force LRU over the routing the layers actually saw, and the inline mode on the same prompts.
Host read-backs are counted as in tests/e2e/test_decode_buffers.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import mira
from allocations import NewTensors
from host_reads import host_reads
from mira.cache.cache import ExpertCache
from mira.cache.policy import LRU, Tier
from mira.cache.slots import SlotPool
from mira.cache.telemetry import Telemetry
from mira.kernels import DECODE_TOKENS
from mira.errors import MiraError
from mira.kernels import make_moe_ffn
from mira.kernels.reference import moe_ffn_reference
from mira.runtime import engine
from mira.runtime.experts import MiraExperts
from mira.runtime.tracing import RoutingRecorder
from mira.cache.transfer import Transfer
from mira.store.store import ExpertStore

L, E, K, H = 3, 8, 2, 64  # the tiny Mixtral: 3 MoE layers, top-2 of 8 experts, hidden 64
GREEDY = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)


def _prompt(length: int = 10) -> torch.Tensor:
    return torch.randint(2, 320, (1, length), generator=torch.Generator().manual_seed(3))


def _budget(store, slots: int) -> int:
    probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
    return probe.plan.reserve_bytes + slots * probe.store.blob_bytes


def _layers(model) -> list[MiraExperts]:
    return sorted((m for m in model.hf_model.modules() if isinstance(m, MiraExperts)), key=lambda m: m.layer_position)


def _call(generator: torch.Generator, tokens: int):
    hidden = torch.randn(tokens, H, generator=generator)
    index = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(tokens)])  # [T, K]
    weights = torch.rand(tokens, K, generator=generator)
    return hidden, index, weights


def _reference(store: ExpertStore, layer: int, hidden, index, weights) -> torch.Tensor:
    blobs = [store.blob(layer, e) for e in range(E)]
    return moe_ffn_reference(hidden.double(), index, weights.double(), blobs, store.layout, F.silu)


def _assert_tables_follow_the_slots(cache: ExpertCache) -> None:
    """Every entry: the slot row of a resident expert, else its host blob; the rows list likewise."""
    tables = cache.tables.tables.tolist()
    experts = cache.store.num_experts
    for layer in range(cache.store.num_layers):
        for expert in range(experts):
            slot = cache._slot_of.get(layer * experts + expert)
            place = cache.store.blob(layer, expert) if slot is None else cache.pool.row(slot)
            assert tables[layer][expert] == place.data_ptr(), (layer, expert, slot)
            assert cache.tables.rows[layer][expert].data_ptr() == place.data_ptr(), (layer, expert, slot)


def _lru_reference(steps: list[list[np.ndarray]], slots: int) -> tuple[np.ndarray, int]:
    """Brute-force LRU over the routing of each step and layer: tokens [L, E, routed/hot/stage/miss]
    and the copies (misses admitted), as Telemetry.counts reports them."""
    counts = np.zeros((L, E, 1 + len(Tier)), dtype=np.int64)
    recency: list[int] = []  # least recent first
    copies = 0
    for step in steps:
        for layer, index in enumerate(step):
            tokens = np.bincount(index.reshape(-1), minlength=E)
            group = set()
            for expert in np.flatnonzero(tokens):
                uid = layer * E + int(expert)
                group.add(uid)
                counts[layer, expert, 0] += tokens[expert]
                if uid in recency:
                    recency.remove(uid)
                    recency.append(uid)
                    counts[layer, expert, 1 + Tier.HOT] += tokens[expert]
                    continue
                counts[layer, expert, 1 + Tier.MISS] += tokens[expert]
                if len(recency) >= slots:
                    victims = [u for u in recency if u not in group]
                    if not victims:
                        continue
                    recency.remove(victims[0])
                recency.append(uid)
                copies += 1
    return counts, copies


def _record_routing(model) -> list[tuple[int, np.ndarray]]:
    """(layer position, top_k_index) of every experts call, in call order."""
    calls: list[tuple[int, np.ndarray]] = []
    for layer in _layers(model):
        layer.register_forward_pre_hook(lambda module, args: calls.append((module.layer_position, args[1].numpy().copy())))
    return calls


def _by_step(calls: list[tuple[int, np.ndarray]]) -> list[list[np.ndarray]]:
    steps: list[list[np.ndarray]] = []
    for layer, index in calls:
        if layer == 0:
            steps.append([])
        steps[-1].append(index)
    assert all(len(step) == L for step in steps)
    return steps


@pytest.mark.parametrize("slots", [8, 13])  # one layer's experts; a little more
def test_lagged_greedy_generation_equals_every_expert_resident_and_transformers(stores, checkpoints, slots):
    store = stores["mixtral", "none"]  # unquantized: Mira computes transformers' own model
    resident = mira.load(store, device="cpu", vram_budget=_budget(store, 24), progress=False)
    assert resident.all_resident and all(layer.lagged for layer in _layers(resident))  # nothing to decide
    expected = resident.generate(_prompt(), **GREEDY)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["mixtral"], dtype=torch.float32).eval()
    assert torch.equal(reference.generate(_prompt(), **GREEDY, disable_compile=True), expected)
    model = mira.load(store, device="cpu", vram_budget=_budget(store, slots), policy="lru", prefetch="off",
                      residency="lagged", progress=False)
    assert all(layer.lagged and layer.host_free for layer in _layers(model))
    assert torch.equal(model.generate(_prompt(), **GREEDY), expected)
    with torch.no_grad():
        got, want = model(_prompt(DECODE_TOKENS + 4)).logits, reference(_prompt(DECODE_TOKENS + 4)).logits
    assert (got - want).abs().max().item() <= 1e-4  # a prefill call: settled, then served inline
    stats = model.stats()["cache"]
    assert stats["copies"] > slots  # the budget forced evictions
    assert stats["tokens_routed"] == (10 + GREEDY["max_new_tokens"] - 1 + DECODE_TOKENS + 4) * L * K


def test_a_lagged_decode_call_reads_nothing_back_and_matches_the_float64_reference(stores, monkeypatch):
    monkeypatch.setattr(engine, "make_moe_ffn", lambda *args, **kwargs: make_moe_ffn(*args, **kwargs, backend="triton"))
    store = stores["mixtral", "int8-shared"]
    model = mira.load(store, device="cpu", vram_budget=_budget(store, 9), policy="lru", prefetch="off",
                      residency="lagged", progress=False)
    monkeypatch.undo()
    layers, cache = _layers(model), model.cache
    assert all(hasattr(layer.ffn, "forward_bases") and layer.lagged for layer in layers)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        calls = [_call(generator, tokens=1 + step) for _ in layers]
        reads = host_reads(monkeypatch)
        outputs = [layer(*args).clone() for layer, args in zip(layers, calls)]
        assert reads == []  # no host sync in a lagged decode call
        cache.settle()
        assert reads == ["numpy"]  # one read-back (a copy into a host buffer) settles every layer
        monkeypatch.undo()
        cache.end_step(1 + step)
        for position, (got, args) in enumerate(zip(outputs, calls)):
            torch.testing.assert_close(got.double(), _reference(model.store, position, *args), rtol=1e-5, atol=1e-5)
        _assert_tables_follow_the_slots(cache)
    assert cache.telemetry.copies > 9  # evictions: the tables changed between steps
    assert cache.telemetry.counts[:, :, 0].sum() == (1 + 2 + 3) * L * K


class _ForgetfulLRU(LRU):
    """LRU that gives up its least recent resident at the end of every step: no shipped policy drops
    residency in end_step, but the mechanism must carry it out."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.dropped: list[int] = []

    def end_step(self, tokens: int) -> None:
        if self._order:
            self.dropped.append(next(iter(self._order)))
            del self._order[self.dropped[-1]]


def test_after_settle_the_tables_hold_slot_rows_for_residents_and_host_blobs_otherwise(stores):
    store = ExpertStore.open(stores["mixtral", "int8-shared"], progress=False)
    slots = 6
    policy = _ForgetfulLRU(slots)
    cache = ExpertCache(store, policy, SlotPool(slots, store.blob_bytes, torch.device("cpu")),
                        Transfer(torch.device("cpu"), slots), Telemetry(L, E))
    ffn = make_moe_ffn("cpu", store.layout, "silu", backend="reference")
    layers = [MiraExperts(p, cache, ffn, torch.device("cpu"), lagged=True) for p in range(L)]
    _assert_tables_follow_the_slots(cache)  # nothing resident: every entry is a host blob
    generator = torch.Generator().manual_seed(1)
    routed = np.zeros((L, E), dtype=np.int64)  # tokens routed per expert, counted here
    evictions = 0
    for step in range(8):
        calls = [_call(generator, tokens=1 + step % 3) for _ in layers]
        for position, (layer, args) in enumerate(zip(layers, calls)):
            np.add.at(routed[position], args[1].numpy().reshape(-1), 1)
            torch.testing.assert_close(layer(*args).double(), _reference(store, position, *args), rtol=1e-5, atol=1e-5)
        before = set(cache._slot_of)
        with NewTensors() as new:  # settling allocates no tensor
            cache.settle()
        assert new.ops == []
        evictions += len(before - set(cache._slot_of))
        _assert_tables_follow_the_slots(cache)
        cache.end_step(1)
        _assert_tables_follow_the_slots(cache)
    assert evictions > 0 and len(policy.dropped) == 8
    # a prefill call after decode calls that were never settled: counted once, none lost
    for position, layer in enumerate(layers):
        args = _call(generator, tokens=2)
        np.add.at(routed[position], args[1].numpy().reshape(-1), 1)
        layer(*args)
    prefill = _call(generator, tokens=DECODE_TOKENS + 1)
    np.add.at(routed[0], prefill[1].numpy().reshape(-1), 1)
    torch.testing.assert_close(layers[0](*prefill).double(), _reference(store, 0, *prefill), rtol=1e-5, atol=1e-5)
    _assert_tables_follow_the_slots(cache)
    assert not cache.tables.pending.any()
    assert np.array_equal(cache.telemetry.counts[:, :, 0], routed)


@pytest.mark.parametrize("policy", ["lru", "mira"])
def test_lagged_telemetry_and_decisions_equal_inline_and_a_brute_force_lru(stores, policy):
    """The policy sees the same accesses in the same order as inline, a step late: the same
    decisions for any policy, so the same telemetry, copies and residents."""
    store = stores["mixtral", "int8-row"]
    budget = _budget(store, 9)
    runs = {}
    for lagged in (True, False):
        model = mira.load(store, device="cpu", vram_budget=budget, policy=policy, prefetch="off",
                          residency="lagged" if lagged else "inline", progress=False)
        assert all(layer.lagged == lagged for layer in _layers(model))
        calls = _record_routing(model)
        tokens = [model.generate(_prompt(length), **GREEDY) for length in (DECODE_TOKENS + 3, 5)]
        runs[lagged] = (model, tokens, _by_step(calls))
    (lagged, lagged_tokens, steps), (inline, inline_tokens, inline_steps) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(lagged_tokens, inline_tokens))
    assert len(steps) == 2 * GREEDY["max_new_tokens"]
    assert all(np.array_equal(a, b) for x, y in zip(steps, inline_steps) for a, b in zip(x, y))
    counts = lagged.cache.telemetry.counts
    assert np.array_equal(counts, inline.cache.telemetry.counts)
    assert lagged.cache.telemetry.summary() == inline.cache.telemetry.summary()
    assert lagged.cache.policy.resident() == inline.cache.policy.resident()
    assert lagged.cache._slot_of == inline.cache._slot_of
    routed = np.zeros((L, E), dtype=np.int64)  # brute force: tokens routed per expert, from the routing seen
    for step in steps:
        for layer, index in enumerate(step):
            np.add.at(routed[layer], index.reshape(-1), 1)
    assert np.array_equal(counts[:, :, 0], routed)
    assert np.array_equal(counts[:, :, 1:].sum(axis=2), routed)
    if policy == "lru":
        expected, copies = _lru_reference(steps, 9)
        assert np.array_equal(counts, expected)
        assert lagged.cache.telemetry.copies == copies > 9


def test_host_free_is_exact_for_resident_lagged_inline_and_predicting_layers(stores, monkeypatch):
    monkeypatch.setattr(engine, "make_moe_ffn", lambda *args, **kwargs: make_moe_ffn(*args, **kwargs, backend="triton"))
    store = stores["mixtral", "int8-shared"]
    resident = mira.load(store, device="cpu", vram_budget=_budget(store, 24), progress=False)
    lagged = mira.load(store, device="cpu", vram_budget=_budget(store, 12), prefetch="off", residency="lagged",
                       progress=False)
    predicting = mira.load(store, device="cpu", vram_budget=_budget(store, 12), prefetch="gate", progress=False)
    inline = mira.load(store, device="cpu", vram_budget=_budget(store, 12), prefetch="off", residency="inline",
                       progress=False)
    monkeypatch.undo()
    models = (resident, lagged, predicting, inline)
    promised = [all(layer.host_free for layer in _layers(model)) for model in models]
    assert promised == [True, True, False, False]  # "auto" on the CPU keeps the predicting mira policy inline
    generator = torch.Generator().manual_seed(2)
    for model, free in zip(models, promised):
        for _ in range(2):  # from the first call on
            reads = host_reads(monkeypatch)
            _layers(model)[0](*_call(generator, tokens=2))
            monkeypatch.undo()
            assert free == (reads == []), (model.stats()["policy"], reads)


def test_an_unknown_residency_is_refused_with_the_fix(stores):
    store = stores["mixtral", "int8-shared"]
    with pytest.raises(MiraError, match="choose one of auto, lagged, inline"):
        mira.load(store, device="cpu", vram_budget=_budget(store, 12), residency="late", progress=False)


@pytest.mark.parametrize("prompt", [10, DECODE_TOKENS + 8])  # a prompt one decode call takes; a prefill
@pytest.mark.parametrize("residency", ["lagged", "inline"])
def test_staging_generates_the_all_resident_text_and_leaves_no_stage_row_in_the_tables(stores, residency, prompt):
    """Prefetching (mira.cache.staging), in either residency: the same text as every expert
    resident; every step's staged entries are back on their blobs or slots when the step ends; the
    copies it issued are prefetches, each used or wasted, and the tokens it served are STAGE."""
    store = stores["mixtral", "int8-shared"]
    resident = mira.load(store, device="cpu", vram_budget=_budget(store, 24), progress=False)
    expected = resident.generate(_prompt(prompt), **GREEDY)
    model = mira.load(store, device="cpu", vram_budget=_budget(store, 12), prefetch="gate", residency=residency,
                      progress=False)
    layers = _layers(model)
    assert all(layer.lagged == layer.host_free == (residency == "lagged") for layer in layers)
    assert [layer._predicts for layer in layers] == [True] + [False] * (L - 1)  # only layer 0 has a layer 2 on
    assert model.cache.policy.capacity == 12 - 3 and model.cache.pool.num_slots == 12  # 3 stage rows
    assert torch.equal(model.generate(_prompt(prompt), **GREEDY), expected)
    _assert_tables_follow_the_slots(model.cache)
    counts, stats = model.stats()["prefetch"], model.stats()["cache"]
    steps = GREEDY["max_new_tokens"]  # forward steps: the prompt's, then one per new token but the last
    assert 0 < counts["issued"] <= steps  # at most one per step: only layer 2 is a target
    assert counts["used"] + counts["wasted"] == counts["issued"] == stats["prefetch_copies"]
    assert counts["used"] > 0 and stats["tokens_served"]["stage"] >= counts["used"]


def test_auto_residency_lags_only_policies_that_never_admit_a_miss_on_the_cpu(stores, tmp_path):
    """On the CPU "auto" lags only where nothing is admitted, and never with a predictor (on CUDA it
    also lags small experts: tests/unit/test_runtime_config.py)."""
    store = stores["mixtral", "int8-shared"]
    budget = _budget(store, 12)
    trace = tmp_path / "profile.npz"
    with RoutingRecorder(mira.load(store, device="cpu", progress=False)) as recorder:
        recorder.model.generate(_prompt(6), **GREEDY)
    recorder.trace().save(trace)

    def lagged(**options) -> bool:
        model = mira.load(store, device="cpu", vram_budget=budget, progress=False, **options)
        layers = _layers(model)
        assert len({layer.lagged for layer in layers}) == 1
        assert model.stats()["residency"] == ("lagged" if layers[0].lagged else "inline")
        return layers[0].lagged

    assert lagged(policy="static", profile=trace) and lagged(policy="on-demand")
    assert not lagged(policy="mira", prefetch="off") and not lagged(policy="lru") and not lagged(policy="lfu")
    assert lagged(policy="mira", prefetch="off", residency="lagged") and lagged(policy="lru", residency="lagged")
    assert not lagged(policy="mira", prefetch="gate")  # on the CPU "auto" lags no policy that admits misses
    assert not lagged(policy="static", profile=trace, residency="inline")


def test_lagged_staging_across_a_prefill_generates_the_unbudgeted_text():
    """The bundled model (12 MoE layers, so ten of them stage): a prefill settles while staged
    experts are still placed for later layers; their entries must still be restored after their
    layer, or a later stage into the same row would serve another expert's bytes."""
    ids = torch.randint(2, 1000, (1, DECODE_TOKENS + 8), generator=torch.Generator().manual_seed(4))
    expected = mira.load(None, device="cpu", progress=False).generate(ids, **GREEDY)
    model = mira.load(None, device="cpu", vram_budget="10%", residency="lagged", prefetch="gate", progress=False)
    assert torch.equal(model.generate(ids, **GREEDY), expected)
    _assert_tables_follow_the_slots(model.cache)
    assert model.stats()["prefetch"]["issued"] > 0



def test_an_inline_settle_names_the_admissions_it_copies_in(stores, monkeypatch):
    """Inline LRU with room for three experts, one layer, one token routed to experts 1 and 5,
    then to 5 and 6, then to 6 and 7: the first call copies both in; the second copies 6 in (5 is
    a hit); the third copies 7 into the least recent one's slot, 1's, beside the hit 6."""
    store = ExpertStore.open(stores["mixtral", "int8-shared"], progress=False)
    cache = ExpertCache(store, LRU(3), SlotPool(3, store.blob_bytes, torch.device("cpu")),
                        Transfer(torch.device("cpu"), 3), Telemetry(L, E))
    layer = MiraExperts(0, cache, make_moe_ffn("cpu", store.layout, "silu", backend="reference"),
                        torch.device("cpu"), lagged=False)
    settled = []
    settle_layer = cache.settle_layer
    monkeypatch.setattr(cache, "settle_layer", lambda position: settled.append(settle_layer(position)) or settled[-1])
    generator = torch.Generator().manual_seed(2)
    for experts in ((1, 5), (5, 6), (6, 7)):
        hidden = torch.randn(1, H, generator=generator)
        index, weights = torch.tensor([experts]), torch.rand(1, K, generator=generator)
        torch.testing.assert_close(layer(hidden, index, weights).double(), _reference(store, 0, hidden, index, weights),
                                   rtol=1e-5, atol=1e-5)
    assert [s.copied for s in settled] == [[(1, 1), (5, 1)], [(6, 1)], [(7, 1)]]
    assert [s.on_device for s in settled] == [[(1, 1), (5, 1)], [(5, 1), (6, 1)], [(6, 1), (7, 1)]]
    assert all(s.from_host == [] for s in settled) and cache.policy.resident() == {5, 6, 7}


@pytest.mark.parametrize("policy", ["lru", "mira"])
def test_a_deferred_settle_decides_as_the_settle_after_each_step(stores, policy):
    """On CUDA a step's settle waits for the next step's start or the call's end (forced here on the
    CPU): the same accesses in the same order, so the same text, telemetry, copies and residents as
    settling after each step; a decode step left unsettled keeps its counts on the device until then."""
    store = stores["mixtral", "int8-row"]
    budget = _budget(store, 9)
    runs = {}
    for defer in (True, False):
        model = mira.load(store, device="cpu", vram_budget=budget, policy=policy, prefetch="off",
                          residency="lagged", progress=False)
        model._defer_settle = defer
        tokens = [model.generate(_prompt(length), **GREEDY) for length in (DECODE_TOKENS + 3, 5)]
        runs[defer] = (model, tokens)
    (deferred, deferred_tokens), (after, after_tokens) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(deferred_tokens, after_tokens))
    assert np.array_equal(deferred.cache.telemetry.counts, after.cache.telemetry.counts)
    assert deferred.cache.telemetry.copies == after.cache.telemetry.copies > 9
    assert deferred.cache.policy.resident() == after.cache.policy.resident()
    assert deferred.cache._slot_of == after.cache._slot_of
    _assert_tables_follow_the_slots(deferred.cache)

    routed = deferred.cache.telemetry.counts[:, :, 0].sum()
    with torch.no_grad():
        deferred(_prompt(1))  # one decode-sized step: counted on the device, not yet settled
    assert deferred.cache.tables.pending.sum().item() == L * K
    assert deferred.cache.telemetry.counts[:, :, 0].sum() == routed
    deferred.finish_step()
    assert not deferred.cache.tables.pending.any()
    assert deferred.cache.telemetry.counts[:, :, 0].sum() == routed + L * K
    _assert_tables_follow_the_slots(deferred.cache)
