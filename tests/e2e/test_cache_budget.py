"""The expert cache changes where experts are read from, never what the model computes."""

import shutil
from pathlib import Path

import pytest
import torch

import mira
from mira.predict.heads import HeadConfig, PredictorHeads, TrainedPredictor, predictor_file, save_heads
from mira.runtime.experts import MiraExperts
from mira.runtime.tracing import RoutingRecorder
from mira.store.manifest import Manifest
from mira.store.store import ExpertStore
from tiny_models import COMMON

GREEDY = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)


def _prompt():
    return torch.randint(2, 320, (1, 10), generator=torch.Generator().manual_seed(3))


def test_greedy_output_is_identical_under_budgets_that_force_evictions(stores):
    store = stores["mixtral", "int8-shared"]
    unlimited = mira.load(store, device="cpu", progress=False)
    expected = unlimited.generate(_prompt(), **GREEDY)
    reserve_probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
    reserve, blob = reserve_probe.plan.reserve_bytes, reserve_probe.store.blob_bytes
    for slots in (8, 13, 24):  # one layer's experts, a little more, every expert
        model = mira.load(store, device="cpu", vram_budget=reserve + slots * blob, policy="lru", progress=False)
        assert model.cache.pool.num_slots == slots
        assert torch.equal(model.generate(_prompt(), **GREEDY), expected)
        stats = model.stats()["cache"]
        lookups = sum(stats["lookups"].values())
        assert stats["tokens_served"]["hot"] + stats["tokens_served"]["miss"] == stats["tokens_routed"] > 0
        assert stats["bytes_to_device"] == stats["copies"] * blob
        if slots < 24:
            assert stats["copies"] == stats["lookups"]["miss"]  # LRU admits every miss
            assert stats["copies"] > slots  # the budget forced evictions
        else:  # every expert fits: all copied in when loading, none missed afterwards
            assert model.stats()["policy"] == "all-resident"
            assert stats["copies"] == 24 and stats["lookups"]["miss"] == 0 and stats["lookups"]["hot"] == lookups


def test_without_a_budget_the_cpu_reads_experts_in_place(stores):
    model = mira.load(stores["olmoe", "int8-row"], device="cpu", progress=False)
    model.generate(_prompt(), **GREEDY)
    stats = model.stats()
    assert stats["slots"] == 0 and stats["cache"]["copies"] == 0
    # 10 prompt tokens + 19 decode steps, 3 MoE layers, top-2 of 8: every routed token counted once
    assert stats["cache"]["tokens_routed"] == (10 + 19) * 3 * 2


def _with_untrained_heads(store: Path, tmp_path: Path) -> Path:
    """A copy of `store` with random predictor heads beside it: what matters here is that staging,
    right or wrong, never changes the output, not how good the predictions are."""
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    manifest = Manifest.read(copy)
    torch.manual_seed(0)
    config = HeadConfig(num_layers=len(manifest.moe_layers), num_experts=manifest.num_experts,
                        top_k=COMMON["num_experts_per_tok"], hidden_size=COMMON["hidden_size"])
    save_heads(PredictorHeads(config), predictor_file(copy), manifest.source_fingerprint, training={})
    return copy


@pytest.mark.parametrize(("policy", "prefetch"), [("mira", "gate"), ("mira", "trained"), ("mira", "off"),
                                                 ("lru", "off"), ("lfu", "off"), ("static", "off"),
                                                 ("on-demand", "off")])
@pytest.mark.parametrize("slots", [8, 12])
def test_greedy_output_is_identical_for_every_policy_budget_and_prefetch(stores, tmp_path, policy, prefetch, slots):
    store = stores["qwen2_moe", "int8-row"]
    if prefetch == "trained":
        store = _with_untrained_heads(store, tmp_path)
    unlimited = mira.load(store, device="cpu", progress=False)
    with RoutingRecorder(unlimited) as recorder:
        recorder.next_sequence()
        expected = unlimited.generate(_prompt(), **GREEDY)
    profile = tmp_path / "profile.npz"
    recorder.trace().save(profile)
    reserve = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False).plan.reserve_bytes
    blob = unlimited.store.blob_bytes
    model = mira.load(store, device="cpu", vram_budget=reserve + slots * blob, policy=policy, profile=profile,
                      prefetch=prefetch, progress=False)
    if prefetch == "trained":
        assert all(isinstance(m.predictor, TrainedPredictor) for m in model.hf_model.modules()
                   if isinstance(m, MiraExperts))
    assert torch.equal(model.generate(_prompt(), **GREEDY), expected)
    prefetched = model.stats()["prefetch"]
    if policy == "mira" and prefetch != "off":
        assert prefetched["issued"] > 0 and model.stats()["cache"]["prefetch_copies"] == prefetched["issued"]
    else:
        assert prefetched["issued"] == 0
    stats = model.stats()["cache"]
    served = stats["tokens_served"]
    assert served["hot"] + served["stage"] + served["miss"] == stats["tokens_routed"] == (10 + 19) * 3 * 2
    if policy == "on-demand":
        assert stats["copies"] == 0 and served["miss"] == stats["tokens_routed"]
    if policy == "static":
        assert stats["copies"] == slots  # placed once, never changed


def test_each_forward_step_reports_its_token_count_to_the_policy(stores, monkeypatch):
    model = mira.load(stores["mixtral", "int8-row"], device="cpu", vram_budget=64 << 20, progress=False)
    steps = []
    monkeypatch.setattr(model.cache.policy, "end_step", steps.append)
    model.generate(_prompt(), max_new_tokens=4, do_sample=False, pad_token_id=0)  # generate keeps 1 logit row
    model(torch.ones(2, 7, dtype=torch.long))
    assert steps == [10, 1, 1, 1, 14]


def test_heads_given_to_load_replace_the_stores_own_and_must_match_the_model(stores, tmp_path):
    def budget_for_12_slots(store: Path) -> int:  # 12 of 24 experts: a budget with STAGE slots
        probe = mira.load(store, device="cpu", vram_budget=1 << 30, progress=False)
        return probe.plan.reserve_bytes + 12 * probe.store.blob_bytes

    store, other = stores["qwen2_moe", "int8-row"], stores["mixtral", "int8-row"]
    heads = predictor_file(_with_untrained_heads(store, tmp_path))
    model = mira.load(store, device="cpu", vram_budget=budget_for_12_slots(store), heads=heads, progress=False)
    assert all(isinstance(m.predictor, TrainedPredictor) for m in model.hf_model.modules()
               if isinstance(m, MiraExperts))  # the store itself has no heads
    with pytest.raises(mira.MiraError, match="trained on another model"):
        mira.load(other, device="cpu", vram_budget=budget_for_12_slots(other), heads=heads, progress=False)


def test_a_runtime_config_and_overrides_on_top_of_it_load_the_same_model(stores):
    store = stores["mixtral", "int8-row"]
    config = mira.RuntimeConfig(device="cpu", vram_budget="50%", progress=False).with_overrides(policy="lru")
    by_config = mira.load(store, config, residency="inline")
    by_name = mira.load(store, device="cpu", vram_budget="50%", policy="lru", residency="inline", progress=False)
    for model in (by_config, by_name):
        stats = model.stats()
        assert (stats["policy"], stats["residency"]) == ("lru", "inline")
        assert stats["slots"] == round(0.5 * stats["total_experts"])
    assert by_config.config == by_name.config
    with pytest.raises(mira.MiraError, match="unknown setting vram"):
        mira.load(store, config, vram="1GiB")
    with pytest.raises(mira.MiraError, match="a path or a hub id"):
        mira.load(123, config)
    with pytest.raises(mira.MiraError, match="cuda_graphs 'yes' is not a bool"):
        mira.load(store, config, cuda_graphs="yes")
    assert mira.RuntimeConfig(vram_budget="24GiB").vram_budget == 24 << 30  # a size, as --vram-budget takes it
    with pytest.raises(mira.MiraError, match="cannot read the size 'lots'"):
        mira.RuntimeConfig(vram_budget="lots")


def test_a_share_too_small_for_one_layer_is_refused_with_the_least_share_that_fits(stores):
    store = ExpertStore.open(stores["mixtral", "int8-row"], progress=False)
    assert (store.num_layers, store.num_experts) == (3, 8)  # 24 experts: 31% gives 7 slots (7.44), 32% 8 (7.68)
    with pytest.raises(mira.MiraError, match=r"31% gives slots for 7 of the model's 24 experts, fewer than the 8 of "
                                             r"one MoE layer.*pass --vram-budget 32% or more"):
        mira.load(store.path, device="cpu", vram_budget="31%", progress=False)
    assert mira.load(store.path, device="cpu", vram_budget="32%", progress=False).stats()["slots"] == 8
