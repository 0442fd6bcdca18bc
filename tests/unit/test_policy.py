"""Residency policies on hand-worked access sequences (paper IV-C, IV-D)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mira.cache.policy import LFU, LRU, Access, Heat, MiraPolicy, OnDemand, Static, Tier, make_policy, split_slots
from mira.config import CacheConfig


def run(policy, groups):
    """Feed groups of uids, one token each, to `policy` (no step ends); returns the answers, flattened."""
    answers = []
    for group in groups:
        policy.begin_group()
        answers.extend(policy.access(uid, 1) for uid in group)
    return answers


MISS_ADMIT = Access(Tier.MISS, admit=True)


def test_lru_evicts_the_least_recently_used():
    policy = LRU(2)
    answers = run(policy, [[1], [2], [1], [3], [2]])
    assert answers == [MISS_ADMIT, MISS_ADMIT, Access(Tier.HOT), Access(Tier.MISS, True, 2), Access(Tier.MISS, True, 1)]
    assert policy.resident() == {3, 2}


def test_lru_never_evicts_an_expert_of_the_current_group():
    policy = LRU(1)
    assert run(policy, [[1, 2]]) == [MISS_ADMIT, Access(Tier.MISS)]  # 2 is served from the host
    assert run(policy, [[2]]) == [Access(Tier.MISS, True, 1)]


def test_lfu_evicts_the_least_frequent_and_breaks_ties_by_recency():
    policy = LFU(2)
    answers = run(policy, [[1], [1], [2], [3], [2], [3]])
    # 3 evicts 2 (1 access) rather than 1 (2 accesses); 2 comes back (now 2 accesses) and evicts 3
    # (1 access); 3 (now 2 accesses) ties with 1 and 2 and evicts 1, the least recently used.
    assert [answer.evict for answer in answers] == [None, None, None, 2, 3, 1]
    assert [answer.tier for answer in answers] == [Tier.MISS, Tier.HOT] + [Tier.MISS] * 4
    assert policy.resident() == {2, 3}


def test_lfu_keeps_counts_of_evicted_experts():
    policy = LFU(1)
    run(policy, [[1], [1], [1], [2], [2]])  # 2 evicts 1, then has 2 accesses
    assert run(policy, [[1]]) == [Access(Tier.MISS, True, 2)]  # 1 has 4 accesses against 2's 2
    assert policy.resident() == {1}


def test_lfu_never_evicts_an_expert_of_the_current_group():
    policy = LFU(2)
    run(policy, [[1], [1], [2]])
    assert run(policy, [[2, 3]]) == [Access(Tier.HOT), Access(Tier.MISS, True, 1)]
    assert run(policy, [[2, 3, 4]]) == [Access(Tier.HOT), Access(Tier.HOT), Access(Tier.MISS)]


def test_static_places_the_most_routed_experts_and_never_admits():
    policy = Static(2, [5, 1, 7, 0])
    assert policy.resident() == {0, 2}
    answers = run(policy, [[0], [1], [1], [2]])
    assert answers == [Access(Tier.HOT), Access(Tier.MISS), Access(Tier.MISS), Access(Tier.HOT)]
    assert policy.resident() == {0, 2}


def test_static_breaks_ties_by_lower_uid_and_skips_unrouted_experts():
    assert Static(1, {7: 3, 4: 3}).resident() == {4}
    assert Static(10, [5, 1, 7, 0]).resident() == {0, 1, 2}


def test_on_demand_serves_everything_from_the_host():
    policy = OnDemand(8)
    assert run(policy, [[1], [1]]) == [Access(Tier.MISS), Access(Tier.MISS)]
    assert policy.resident() == set()


@pytest.mark.parametrize(
    ("capacity", "total", "expected"),
    [
        (64, 256, (48, 16)),  # 25% fit: large-VRAM mode, 25% STAGE
        (32, 256, (28, 4)),  # 12.5% fit: small-VRAM mode, 12.5% STAGE
        (8, 256, (7, 1)),
        (3, 256, (2, 1)),  # at least one STAGE slot
        (2, 2, (1, 1)),  # at least one HOT slot
        (1, 256, (1, 0)),
        (0, 256, (0, 0)),
    ],
)
def test_split_slots_by_vram_mode(capacity, total, expected):
    config = CacheConfig(small_vram_fraction=0.25, stage_fraction_small=0.125, stage_fraction_large=0.25)
    assert split_slots(capacity, total, config) == expected


def test_heat_decays_per_step_and_survives_rescaling():
    heat = Heat(0.5)
    heat.add(1, 4)
    heat.advance(1)
    heat.add(2, 1)
    assert (heat[1], heat[2], heat[3]) == (2.0, 1.0, 0.0)
    heat.advance(400)  # units grow past 1e100 and are brought back
    heat.add(2, 3)
    assert heat[2] == pytest.approx(3.0)
    assert 0 < heat[1] < 1e-100
    heat.advance(5000)  # one long prefill step: 0.5 ** 5000 underflows
    heat.add(3, 1)
    assert (heat[1], heat[2], heat[3]) == (0.0, 0.0, 1.0)


def mira(capacity=4, stage_slots=1, **config):
    return MiraPolicy(capacity, 100, CacheConfig(**config), stage_slots=stage_slots)


def test_mira_fills_hot_first_then_stage():
    policy = mira()
    answers = run(policy, [[1, 2, 3], [4]])
    assert answers == [MISS_ADMIT] * 4
    assert [policy.tier_of(uid) for uid in (1, 2, 3, 4, 5)] == [Tier.HOT] * 3 + [Tier.STAGE, Tier.MISS]


def test_mira_miss_replaces_the_least_valuable_stage_entry_or_is_bypassed():
    policy = mira(capacity=4, stage_slots=2, rebalance_interval=1000)
    run(policy, [[1, 2], [3], [4], [4], [5]])  # HOT {1, 2}; STAGE {3, 4}, 4 hotter than 3
    assert policy.tier_of(5) is Tier.STAGE and policy.tier_of(3) is Tier.MISS  # 5 (heat 1, recent) replaced 3
    assert run(policy, [[6]]) == [Access(Tier.MISS, True, 5)]  # equal heat: the less recent 5 goes
    policy.begin_group()
    assert policy.access(7, 1) == Access(Tier.MISS, True, 6)
    assert policy.access(8, 1) == Access(Tier.MISS)  # 4 is hotter than 8, 7 is in this group: bypass


def test_mira_rebalance_promotes_a_busy_stage_expert_over_an_idle_hot_one():
    policy = mira(capacity=3, stage_slots=1, rebalance_interval=4, max_swaps=1)
    run(policy, [[1, 2], [3], [3], [3]])  # HOT {1, 2} idle since the first group, 3 busy in STAGE
    assert policy.tier_of(3) is Tier.STAGE
    policy.end_step(4)
    assert (policy.tier_of(3), policy.tier_of(1), policy.tier_of(2)) == (Tier.HOT, Tier.STAGE, Tier.HOT)
    assert policy.resident() == {1, 2, 3}  # a hand-over of slots: nothing admitted or evicted
    assert policy.telemetry.window == {}  # window reset
    assert policy.telemetry.total[3] == [0, 2, 1]  # 1 token missed, 2 served from STAGE


def test_mira_rebalance_respects_the_swap_bound_and_keeps_better_hot_experts():
    policy = mira(capacity=6, stage_slots=3, rebalance_interval=1000, max_swaps=2)
    run(policy, [[1, 2, 3], [4, 5, 6], [4, 5, 6], [4, 5, 6]])  # 4, 5, 6 outrank the idle HOT 1, 2, 3
    swaps = policy.rebalance()
    assert len(swaps) == 2
    assert sum(policy.tier_of(uid) is Tier.HOT for uid in (4, 5, 6)) == 2
    assert policy.rebalance() == []  # no traffic in the new window: no candidates

    steady = mira(capacity=3, stage_slots=1, rebalance_interval=1000, max_swaps=4)
    run(steady, [[1, 2], [1, 2], [1, 2, 3], [1, 2]])  # 3 has traffic but less than HOT 1 and 2
    assert steady.rebalance() == []
    assert steady.tier_of(3) is Tier.STAGE


def test_mira_stage_takes_a_free_slot_or_displaces_probation_but_never_a_staged_expert():
    policy = mira(capacity=4, stage_slots=2)
    run(policy, [[1, 2], [3], []])  # HOT {1, 2}; 3 on probation in STAGE; a new group has begun
    assert policy.stage(1) == Access(Tier.HOT)  # already resident: skipped
    assert policy.stage(9) == MISS_ADMIT  # the free STAGE slot
    assert policy.stage(8) == Access(Tier.MISS, admit=True, evict=3)  # a prediction outranks probation
    assert policy.stage(7) == Access(Tier.MISS)  # STAGE holds staged experts only: declined
    policy.begin_group()
    assert policy.access(6, 1) == Access(Tier.MISS)  # nor may a miss take a staged expert's slot
    policy.release(9)
    assert policy.resident() == {1, 2, 8} and policy.tier_of(9) is Tier.MISS
    assert policy.access(5, 1) == MISS_ADMIT  # the released slot is free again
    assert policy.stage(7) == Access(Tier.MISS)  # 5 is in the current group, 8 is staged


def test_mira_rebalance_leaves_staged_experts_to_the_prefetcher():
    policy = mira(capacity=3, stage_slots=1, rebalance_interval=1000, max_swaps=1)
    run(policy, [[1, 2]])  # HOT {1, 2}, idle from now on
    policy.stage(9)
    run(policy, [[9], [9], [9]])  # busy in STAGE, but staged for a layer that has not finished
    assert policy.rebalance() == [] and policy.tier_of(9) is Tier.STAGE
    policy.release(9)
    run(policy, [[9], [9]])  # now a miss on probation, and as busy
    assert policy.rebalance() == [(9, 1)]  # the idle HOT expert 1 (older than 2) makes room


def test_single_tier_policies_decline_staging():
    policy = LRU(4)
    assert policy.stage(3) == Access(Tier.MISS)
    assert policy.resident() == set()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        LRU(-1)
    with pytest.raises(ValueError, match="stage_slots must be between 0 and the capacity 4"):
        mira(capacity=4, stage_slots=5)
    with pytest.raises(ValueError, match="heat decay"):
        Heat(0.0)


def test_make_policy_builds_each_policy_by_name():
    config = CacheConfig(small_vram_fraction=0.25, stage_fraction_large=0.25)
    built = {name: make_policy(name, 4, 16, config, profile=[1] * 16)
             for name in ("mira", "lru", "lfu", "static", "on-demand")}
    assert {name: type(policy).__name__ for name, policy in built.items()} == {
        "mira": "MiraPolicy", "lru": "LRU", "lfu": "LFU", "static": "Static", "on-demand": "OnDemand"}
    assert (built["mira"].hot_slots, built["mira"].stage_slots) == (3, 1)
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        make_policy("fifo", 4, 16)


def test_mira_takes_the_heat_decay_from_the_config_when_it_has_one():
    @dataclass(frozen=True)
    class WithDecay(CacheConfig):
        heat_decay: float = 0.5

    policy = MiraPolicy(4, 16, WithDecay(rebalance_interval=100))
    policy.begin_group()
    policy.access(1, 4)
    policy.end_step(1)
    assert policy.heat(1) == 2.0
