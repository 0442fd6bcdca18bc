"""Predictive staging (paper IV-E) through the simulator's checked slot mechanism."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mira.cache.policy import MiraPolicy, Tier
from mira.cache.simulate import simulate
from mira.config import CacheConfig
from mira.predict.prefetcher import PrefetchBook
from mira.predict.trace import RoutingTrace
from test_simulate import ONLINE, routing


@settings(max_examples=120, deadline=None)
@given(routing(), st.sampled_from(ONLINE), st.integers(0, 2**32 - 1))
def test_prefetching_keeps_the_mechanism_contract_and_its_counts_add_up(case, policy, seed):
    trace, slots, config, stage_slots = case
    rng = np.random.default_rng(seed)
    predictions = rng.integers(-1, trace.num_experts, size=(*trace.topk_ids.shape[:2], 2))
    result = simulate(trace, policy, slots, stage_slots=stage_slots, config=config, check=True,
                      predictions=predictions)
    assert result["prefetch_used"] + result["prefetch_wasted"] == result["prefetch_issued"]
    assert result["hits"] + result["misses"] == result["accesses"]
    if policy != "mira":
        assert result["prefetch_issued"] == 0  # single-tier policies have no STAGE to stage into


def test_perfect_predictions_remove_the_misses_of_predicted_layers():
    # 2 experts per layer, 4 layers, top-1, alternating every token: HOT (1 slot) cannot keep up.
    ids = np.array([[[t % 2]] * 4 for t in range(40)], dtype=np.int16)
    trace = RoutingTrace(ids, num_experts=2)
    config = CacheConfig()
    off = simulate(trace, "mira", 4, stage_slots=3, config=config)
    on = simulate(trace, "mira", 4, stage_slots=3, config=config, predictions=ids.astype(np.int64))
    assert on["misses"] < off["misses"]
    # every access to layers 2 and 3 (predicted from layers 0 and 1) is served from a slot
    assert on["prefetch_used"] == on["prefetch_issued"] > 0 and on["prefetch_wasted"] == 0


def test_book_hand_worked_skip_decline_use_waste():
    policy = MiraPolicy(capacity=3, total_experts=100, config=CacheConfig(), stage_slots=2)
    policy.begin_group()
    policy.access(50, 1)  # a miss fills HOT (1 slot)
    book, copied = PrefetchBook(), []
    book.stage(policy, target_layer=7, uids=[50, 70, 71, 70], admit=lambda uid, access: copied.append(uid))
    assert copied == [70, 71]  # 50 resident: skipped; 70 offered twice: copied once
    book.stage(policy, target_layer=8, uids=[80], admit=lambda uid, access: copied.append(uid))
    assert copied == [70, 71, 80] and policy.tier_of(70) is Tier.MISS  # 80 displaced the older staged 70
    released = book.after_layer(policy, 7, routed=[71])
    assert released == [71]  # used, then reclaimed right after use (70 had already been displaced)
    assert book.counts.as_dict() == {"issued": 3, "skipped": 1, "declined": 0, "used": 1, "wasted": 1}
    assert policy.resident() == {50, 80}
