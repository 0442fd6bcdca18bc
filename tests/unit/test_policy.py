"""Residency policies on hand-worked access sequences (paper IV-C, IV-D)."""

from __future__ import annotations

import pytest

from mira.cache.policy import (LFU, LRU, Access, Heat, MiraPolicy, OnDemand, Popularity, Static, Tier, make_policy,
                               split_slots)
from mira.cache.config import CacheConfig


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
    policy = Static(2, Popularity((5, 1, 7, 0), 10))
    assert policy.resident() == {0, 2}
    answers = run(policy, [[0], [1], [1], [2]])
    assert answers == [Access(Tier.HOT), Access(Tier.MISS), Access(Tier.MISS), Access(Tier.HOT)]
    assert policy.resident() == {0, 2}


def test_static_breaks_ties_by_lower_uid_and_skips_unrouted_experts():
    assert Static(1, Popularity((0, 0, 0, 0, 3, 0, 0, 3), 3)).resident() == {4}
    assert Static(10, Popularity((5, 1, 7, 0), 10)).resident() == {0, 1, 2}


def test_popularity_rates_and_routing_counts():
    popularity = Popularity.of_routing([6, 2, 0, 4, 4, 0], top_k=2, num_layers=2)  # 2 tokens per layer... x2
    assert popularity.tokens == 4 and popularity.rate(0) == 1.5 and popularity.rate(2) == 0.0
    assert popularity.ranked() == [0, 3, 4, 1]
    with pytest.raises(ValueError, match="no negative"):
        Popularity((1, -1), 2)


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
    heat = Heat(0.5, 4)
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


def mira(capacity=4, stage_slots=1, prior=None, admission_cost=0.0, **config):  # inline-cost cases by default
    config.setdefault("heat_decay", 0.5)  # a horizon of 2 steps: every figure below is worked by hand
    config.setdefault("admission_margin", 0.0)
    return MiraPolicy(capacity, 100, CacheConfig(**config), stage_slots=stage_slots, prior=prior,
                      admission_cost=admission_cost)


def steps(policy, groups):
    """Feed each group as one token step of one token (the step ends after it); returns the answers."""
    answers = []
    for group in groups:
        answers.extend(run(policy, [group]))
        policy.end_step(1)
    return answers


def test_mira_with_no_evidence_is_the_static_placement():
    popularity = Popularity((5, 1, 7, 0, 2), 10)
    policy = mira(capacity=3, stage_slots=1, prior=popularity)
    assert policy.resident() == Static(3, popularity).resident() == {0, 2, 4}
    assert (policy.tier_of(2), policy.tier_of(0), policy.tier_of(4)) == (Tier.HOT, Tier.HOT, Tier.STAGE)


def test_mira_admits_inline_what_is_worth_more_than_its_victim():
    # heat decay 0.5: expected rate = heat / (steps covered: 1, then 1.5, 1.75, ...); a slot saves
    # rate x 2 (the horizon) blobs; inline an admission costs nothing beyond the miss's own copy.
    policy = mira(capacity=2, stage_slots=1)
    assert steps(policy, [[1], [2]]) == [MISS_ADMIT, MISS_ADMIT]  # free HOT, then free STAGE slots
    # after two steps 1 has heat 0.25 and 2 has 0.5, over 1.75 steps: the rebalancer swapped them
    assert (policy.tier_of(2), policy.tier_of(1)) == (Tier.HOT, Tier.STAGE)
    assert steps(policy, [[3]]) == [Access(Tier.MISS, True, 1)]  # 1/1.75 > 0.25/1.75: 3 replaces STAGE's 1
    assert (policy.tier_of(3), policy.tier_of(2)) == (Tier.HOT, Tier.STAGE)  # 3, now busier, promoted after the step


def test_mira_lagged_admits_only_when_the_reuse_pays_for_the_second_crossing():
    policy = mira(capacity=2, stage_slots=1, admission_cost=1.0)
    assert steps(policy, [[1], [2]]) == [MISS_ADMIT, MISS_ADMIT]  # saves 2 > 1 in a free slot
    # (rebalanced: STAGE holds 1, heat 0.25.) 3 once: (1 - 0.25) / 1.75 x 2 = 0.86 blobs more than 1
    # would save: not worth a crossing
    assert steps(policy, [[3]]) == [Access(Tier.MISS)]
    # 3 again: heat 1.5 against 1's 0.125, over 1.875 steps: (1.5 - 0.125) / 1.875 x 2 = 1.47 > 1
    assert steps(policy, [[3]]) == [Access(Tier.MISS, True, 1)]


def test_mira_prior_weight_sets_how_much_evidence_moves_the_placement():
    popularity = Popularity((0, 1, 0, 0, 2), 10)  # rates 0.1 (uid 1) and 0.2 (uid 4)
    trusting = mira(capacity=1, stage_slots=1, prior=popularity, prior_weight=1000.0)
    assert trusting.resident() == {4}
    # uid 1 once: (1 + 100) / 1001 against 4's 200 / 1001: the profile wins
    assert run(trusting, [[1]]) == [Access(Tier.MISS)]
    doubting = mira(capacity=1, stage_slots=1, prior=popularity, prior_weight=0.0)
    assert run(doubting, [[1]]) == [Access(Tier.MISS, True, 4)]  # the routing seen now wins


def test_mira_rebalance_swaps_stage_entries_worth_more_than_hot_ones_within_the_bound():
    policy = mira(capacity=3, stage_slots=1)
    steps(policy, [[1, 2], [3]])  # HOT {1, 2}, STAGE {3}
    # 3 again: heat 1.5 x 0.5 = 0.75 against 0.125 for 1 and 2 after the step: 3 swaps with 1 (lower uid)
    run(policy, [[3]])
    policy.end_step(1)
    assert (policy.tier_of(3), policy.tier_of(1), policy.tier_of(2)) == (Tier.HOT, Tier.STAGE, Tier.HOT)
    assert policy.resident() == {1, 2, 3}  # a hand-over of slots: nothing admitted or evicted
    assert policy.rebalance() == []  # STAGE's 1 is worth less than HOT's 2 and 3

    bounded = mira(capacity=4, stage_slots=2, max_swaps=1, rebalance_interval=1000)
    steps(bounded, [[1, 2], [3, 4], [3, 4]])
    assert bounded.rebalance() == [(4, 1)]  # two candidates, one swap: best (tie: higher uid) for worst


def test_mira_may_evict_an_expert_used_earlier_in_the_step_but_not_in_the_group():
    policy = mira(capacity=2, stage_slots=1)
    steps(policy, [[1], [2]])  # HOT {2}, STAGE {1} after the rebalance; 1.75 steps of evidence
    # one step: 1 is a STAGE hit (heat 1.25); 3 once (heat 1) is worth less; twice (2) more
    assert run(policy, [[1], [3], [3]]) == [Access(Tier.STAGE), Access(Tier.MISS), Access(Tier.MISS, True, 1)]
    # STAGE's only entry, 3, is in the current group: 4 is served from the host, not admitted
    assert run(policy, [[3, 4]]) == [Access(Tier.STAGE), Access(Tier.MISS)]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        LRU(-1)
    with pytest.raises(ValueError, match="stage_slots must be between 0 and the capacity 4"):
        mira(capacity=4, stage_slots=5)
    with pytest.raises(ValueError, match="admission_cost must be >= 0"):
        mira(admission_cost=-1.0)
    with pytest.raises(ValueError, match="heat decay"):
        Heat(0.0, 4)
    with pytest.raises(ValueError, match="prior_weight"):
        CacheConfig(prior_weight=-1.0)


def test_the_admission_margin_adds_to_the_cost():
    """A margin of one blob inline decides as a lagged admission's one crossing does (the test above)."""
    policy = mira(capacity=2, stage_slots=1, admission_margin=1.0)
    assert steps(policy, [[1], [2]]) == [MISS_ADMIT, MISS_ADMIT]
    assert steps(policy, [[3]]) == [Access(Tier.MISS)]  # saves 0.86 more than 1: not more than 0 + 1
    assert steps(policy, [[3]]) == [Access(Tier.MISS, True, 1)]  # 1.47 > 1
    with pytest.raises(ValueError, match="admission_margin must be >= 0"):
        CacheConfig(admission_margin=-0.5)


def test_make_policy_builds_each_policy_by_name():
    config = CacheConfig(small_vram_fraction=0.25, stage_fraction_large=0.25)
    profile = Popularity((1,) * 16, 1)
    built = {name: make_policy(name, 4, 16, config, profile=profile)
             for name in ("mira", "lru", "lfu", "static", "on-demand")}
    assert {name: type(policy).__name__ for name, policy in built.items()} == {
        "mira": "MiraPolicy", "lru": "LRU", "lfu": "LFU", "static": "Static", "on-demand": "OnDemand"}
    assert (built["mira"].hot_slots, built["mira"].stage_slots) == (3, 1)
    assert built["mira"].resident() == built["static"].resident() == {0, 1, 2, 3}
    assert make_policy("mira", 4, 16, config).admission_cost == 1.0  # an admission is one more crossing
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        make_policy("fifo", 4, 16)
