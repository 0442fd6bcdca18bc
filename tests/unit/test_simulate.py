"""The simulator and every policy under random routing: the mechanism's contract, telemetry, Belady's bound."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mira.cache.policy import LRU, Access, Policy, Popularity, Tier, make_policy
from mira.bench.simulate import (
    POLICIES,
    PolicyContractError,
    format_table,
    plot_sweep,
    replay,
    simulate,
    sweep,
)
from mira.cache.config import CacheConfig
from mira.store.trace import RoutingTrace

ONLINE = [name for name in POLICIES if name != "belady"]


@st.composite
def routing(draw):
    """A random trace, a slot count from none to more than all experts, and a mira configuration."""
    tokens, layers = draw(st.integers(1, 10)), draw(st.integers(1, 3))
    experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, 3))
    size = tokens * layers * top_k
    ids = np.array(draw(st.lists(st.integers(0, experts - 1), min_size=size, max_size=size)), dtype=np.int16)
    trace = RoutingTrace(ids.reshape(tokens, layers, top_k), experts)
    slots = draw(st.integers(0, layers * experts + 1))
    config = CacheConfig(rebalance_interval=draw(st.integers(1, 4)), max_swaps=draw(st.integers(0, 3)))
    stage_slots = draw(st.none() | st.integers(0, slots))
    return trace, slots, config, stage_slots


def routed_counts(trace: RoutingTrace) -> tuple[Counter, Counter]:
    """Per (token, layer, uid) and per uid: tokens routed, counted straight from topk_ids."""
    per_group, per_uid = Counter(), Counter()
    for token, per_layer in enumerate(trace.topk_ids.tolist()):
        for layer, ids in enumerate(per_layer):
            for expert in ids:
                uid = layer * trace.num_experts + expert
                per_group[token, layer, uid] += 1
                per_uid[uid] += 1
    return per_group, per_uid


@settings(max_examples=150, deadline=None)
@given(routing(), st.sampled_from(ONLINE), st.sampled_from(["inline", "lagged"]))
def test_every_policy_keeps_the_mechanism_contract_and_the_counts_add_up(case, policy, residency):
    trace, slots, config, stage_slots = case
    result = simulate(trace, policy, slots, stage_slots=stage_slots, config=config, check=True, residency=residency)
    per_group, _ = routed_counts(trace)
    assert result["accesses"] == len(per_group)
    assert result["tokens_routed"] == trace.topk_ids.size
    assert result["hits"] + result["misses"] == result["accesses"]
    assert result["hits_hot"] + result["hits_stage"] == result["hits"]
    assert result["tokens_hot"] + result["tokens_stage"] + result["tokens_miss"] == result["tokens_routed"]
    assert result["admissions"] <= result["misses"]
    assert result["copies"] == result["misses"] + (result["admissions"] if residency == "lagged" else 0)
    assert result["hot_slots"] + result["stage_slots"] == slots
    if policy != "mira":
        assert result["hits_stage"] == 0
    if policy == "on-demand" or slots == 0:
        assert result["misses"] == result["accesses"]
    # Belady's optimum, free to start from the best contents, bounds every policy, those whose
    # placement is loaded before the first access (static, mira) too
    assert simulate(trace, "belady", slots)["misses"] <= result["misses"]
    routed_experts = len(set(trace.uid_sequence().tolist()))
    assert result["preloaded"] == (min(slots, routed_experts) if policy in ("static", "mira") else 0)


class Recorder(Policy):
    """Wraps a policy and records every access the mechanism makes, by group."""

    def __init__(self, inner: Policy):
        super().__init__(inner.capacity)
        self.inner, self.hot_slots, self.stage_slots, self.name = inner, inner.hot_slots, inner.stage_slots, inner.name
        self.groups: list[list[tuple[int, int]]] = []

    def begin_group(self) -> None:
        super().begin_group()
        self.inner.begin_group()
        self.groups.append([])

    def _access(self, uid: int, tokens: int) -> Access:
        self.groups[-1].append((uid, tokens))
        return self.inner.access(uid, tokens)

    def resident(self) -> set[int]:
        return self.inner.resident()

    def tier_of(self, uid: int) -> Tier:
        return self.inner.tier_of(uid)

    def end_step(self, tokens: int) -> None:
        self.inner.end_step(tokens)


@settings(max_examples=80, deadline=None)
@given(routing(), st.sampled_from(ONLINE))
def test_each_routed_expert_is_served_exactly_once_per_token_and_layer(case, policy):
    trace, slots, config, stage_slots = case
    recorder = Recorder(make_policy(policy, slots, trace.num_uids, config, Popularity((1,) * trace.num_uids, 1),
                                    stage_slots))
    replay(trace, recorder, check=True)
    per_group, _ = routed_counts(trace)
    served = Counter()
    for index, group in enumerate(recorder.groups):
        token, layer = divmod(index, trace.num_layers)
        assert [uid for uid, _ in group] == sorted({uid for uid, _ in group})  # once each, ascending
        for uid, tokens in group:
            served[token, layer, uid] += tokens
    assert served == per_group


@settings(max_examples=80, deadline=None)
@given(routing())
def test_mira_trusting_its_profile_moves_exactly_what_static_placement_moves(case):
    trace, slots, config, _ = case
    trusting = CacheConfig(prior_weight=1e12)  # no routing seen can outweigh the profile
    mira = simulate(trace, "mira", slots, config=trusting, residency="lagged")
    static = simulate(trace, "static", slots)
    assert (mira["admissions"], mira["misses"], mira["copies"]) == (0, static["misses"], static["copies"])


def _trace(ids, num_experts) -> RoutingTrace:
    return RoutingTrace(np.asarray(ids, dtype=np.int16), num_experts)


class Broken(Policy):
    """Answers a scripted list, to check that the mechanism catches each kind of broken answer."""

    name = "broken"

    def __init__(self, capacity, answers, resident=(), hot_slots=None):
        super().__init__(capacity)
        self._answers, self._resident = list(answers), set(resident)
        if hot_slots is not None:
            self.hot_slots = hot_slots

    def _access(self, uid, tokens):
        answer = self._answers.pop(0)
        if answer.admit:
            self._resident.discard(answer.evict)
            self._resident.add(uid)
        return answer

    def resident(self):
        return set(self._resident)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (Broken(1, [Access(Tier.MISS, True), Access(Tier.MISS, True, 0)]),
         "evicts uid 0, accessed in the current group"),
        (Broken(1, [Access(Tier.MISS, True), Access(Tier.MISS, True)]), "admits into a free slot, but all 1 are taken"),
        (Broken(2, [Access(Tier.HOT)]), "answered HOT for uid 0, resident=False"),
        (Broken(2, [Access(Tier.MISS, True, 5)]), "evicts uid 5, which holds no slot"),
        (Broken(2, [Access(Tier.MISS)], resident=[0]), "answered MISS for uid 0, resident=True"),
        (Broken(1, [], resident=[0, 1]), "starts with 2 residents in 1 slots"),
        (Broken(2, [Access(Tier.MISS, True), Access(Tier.MISS, True)], hot_slots=1),
         "2 HOT and 0 STAGE residents exceed"),
    ],
)
def test_the_mechanism_catches_a_policy_breaking_its_contract(policy, message):
    with pytest.raises(PolicyContractError, match=message):
        replay(_trace([[[0, 1]]], 2), policy, check=True)


def test_the_full_check_catches_a_resident_set_that_disagrees_with_the_slots():
    class Forgetful(LRU):
        def resident(self):
            return set()

    replay(_trace([[[0, 1]]], 2), Forgetful(2))  # the per-access checks alone cannot see it
    with pytest.raises(PolicyContractError, match="resident\\(\\) differs"):
        replay(_trace([[[0, 1]]], 2), Forgetful(2), check=True)


def test_simulate_reports_misses_and_pcie_cost():
    trace = _trace([[[0, 1]], [[0, 2]], [[0, 1]]], 3)  # accesses 0 1 | 0 2 | 0 1
    result = simulate(trace, "lru", 2, expert_bytes=1000, bandwidth_gbps=1e-6)
    assert (result["accesses"], result["hits"], result["misses"], result["hits_hot"]) == (6, 2, 4, 2)
    assert result["hit_rate"] == pytest.approx(2 / 6) and result["miss_rate"] == pytest.approx(4 / 6)
    assert result["pcie_bytes"] == 4000
    assert result["pcie_seconds_per_token"] == pytest.approx(4000 / 1000 / 3)  # 1e-6 GB/s = 1000 B/s, 3 tokens
    belady = simulate(trace, "belady", 2, expert_bytes=1000)
    assert (belady["misses"], belady["policy"], belady["preloaded"]) == (1, "belady", 2)  # it starts with 0 and 1;
    # 2 is bypassed at token 1


def test_static_profile_defaults_to_the_trace_itself_and_says_so():
    trace = _trace([[[0]], [[1]], [[1]]], 2)
    oracle = simulate(trace, "static", 1)
    assert oracle["profile"].startswith("oracle")
    assert oracle["misses"] == 1  # expert 1 placed
    other = _trace([[[0]]], 2)
    profiled = simulate(trace, "static", 1, profile=other)
    assert profiled["profile"] == "<memory>"
    assert profiled["misses"] == 2  # expert 0 placed from the other profile


def test_bad_arguments_are_refused():
    trace = _trace([[[0]]], 2)
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        simulate(trace, "fifo", 1)
    with pytest.raises(ValueError, match="slots must be >= 0"):
        simulate(trace, "lru", -1)
    with pytest.raises(ValueError, match="needs a profile"):
        make_policy("static", 1, 2)
    with pytest.raises(ValueError, match=r"routes over 1 layers x 3 experts but the trace <memory> has 1 x 2; record"):
        simulate(trace, "static", 1, profile=_trace([[[0]]], 3))
    four = _trace([[[0]]], 4)  # 1 layer of 4 experts: as many as 2 layers of 2, yet another model
    with pytest.raises(ValueError, match=r"routes over 2 layers x 2 experts but the trace <memory> has 1 x 4"):
        simulate(four, "mira", 1, profile=_trace([[[0], [1]]], 2))


def _small_sweep() -> list[dict]:
    trace = _trace(np.random.default_rng(0).integers(0, 4, size=(40, 2, 2)), 4)
    return sweep(trace, [2, 4], ["lru", "belady"])


def test_sweep_and_table():
    results = _small_sweep()
    assert [(row["slots"], row["policy"]) for row in results] == [(2, "lru"), (2, "belady"), (4, "lru"), (4, "belady")]
    table = format_table(results).splitlines()
    assert table[0].split()[:3] == ["policy", "residency", "slots"] and len(table) == 5
    lru_row = results[0]
    ratio = lru_row["misses"] / results[1]["misses"]
    assert table[1].split()[0] == "lru" and table[1].split()[-1] == f"{ratio:.2f}"
    assert table[2].split()[-1] == "1.00"


def test_the_table_tells_a_policy_that_copies_where_belady_copies_nothing():
    alternating = _trace([[[0]], [[1]], [[0]], [[1]]], 2)  # both experts fit: Belady (warm) never misses
    table = format_table(sweep(alternating, [1, 2], ["lru", "static", "belady"])).splitlines()
    cells = {(line.split()[0], line.split()[2]): line.split()[-1] for line in table[1:]}
    assert cells[("lru", "2")] == "inf"  # LRU starts empty: 2 cold misses against none
    assert cells[("static", "2")] == cells[("belady", "2")] == "1.00"
    assert cells[("lru", "1")] == "2.00"  # 1 slot: LRU misses all 4; Belady keeps 0 and bypasses both 1s


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "sweep.png"
    plot_sweep(_small_sweep(), str(path), title="random routing")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
