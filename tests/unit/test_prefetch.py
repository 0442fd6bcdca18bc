"""Predictive staging (paper IV-E) through the simulator's checked slot mechanism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mira.cache.policy import MiraPolicy
from mira.bench.simulate import PolicyContractError, replay, simulate
from mira.cache.config import CacheConfig
from mira.cache.prefetcher import PrefetchBook
from mira.store.trace import RoutingTrace
from test_simulate import ONLINE, routing


@settings(max_examples=150, deadline=None)
@given(routing(), st.sampled_from(ONLINE), st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_prefetching_keeps_the_mechanism_contract_and_its_counts_add_up(case, policy, seed, per_layer):
    trace, slots, config, stage_slots = case
    rng = np.random.default_rng(seed)
    prompt = int(rng.integers(0, trace.num_tokens + 1))  # the first tokens are one prompt step
    trace = RoutingTrace(trace.topk_ids, trace.num_experts, seq_id=np.zeros(trace.num_tokens, np.int32),
                         is_prefill=np.arange(trace.num_tokens) < prompt)
    predictions = rng.integers(-1, trace.num_experts, size=(*trace.topk_ids.shape[:2], 3))
    # check=True: among the rest, no admission may take the slot of an expert staged for a layer still to come
    result = simulate(trace, policy, slots, stage_slots=stage_slots, config=config, check=True,
                      predictions=predictions, staged_per_layer=per_layer)
    assert result["prefetch_used"] + result["prefetch_wasted"] == result["prefetch_issued"]
    assert result["hits"] + result["misses"] == result["accesses"]
    assert result["copies"] == result["misses"] + result["prefetch_issued"]
    assert result["prefetch_issued"] <= per_layer * trace.num_tokens * max(trace.num_layers - 2, 0)
    # Fetching ahead never moves fewer blobs than Belady's optimum (with bypass) at the same slot
    # count: any schedule can fetch each blob lazily, at its use, without more copies.
    assert simulate(trace, "belady", slots)["misses"] <= result["copies"] + result["preloaded"]
    if policy != "mira":
        assert result["prefetch_issued"] == 0  # single-tier policies have no STAGE to stage into


def test_the_mechanism_catches_a_policy_that_displaces_a_staged_expert():
    class Impatient(MiraPolicy):  # an older rule: any STAGE entry outside the group may make room
        def _stage_victim(self):
            evictable = self._stage - self._group
            return int(self._ranked(evictable)[0]) if evictable else None

    ids = np.array([[[0], [1], [2]], [[3], [3], [3]]], dtype=np.int16)  # 2 tokens, 3 layers, top-1 of 4
    predictions = np.array([[[-1], [-1], [2]], [[-1], [-1], [3]]])
    trace = RoutingTrace(ids, num_experts=4)
    with pytest.raises(PolicyContractError, match="evicts uid 10, staged for a layer that has not run yet"):
        # token 0: uid 0 fills HOT, layer 2's expert 2 (uid 10) is staged, then the miss of uid 5 displaces it
        replay(trace, Impatient(2, 12, CacheConfig(), stage_slots=1), check=True, predictions=predictions)
    counts = replay(trace, MiraPolicy(2, 12, CacheConfig(), stage_slots=1), check=True, predictions=predictions)
    # uid 10 staged and used; token 1's uid 11 declined: STAGE holds uid 3, a miss of the current group
    assert (counts["prefetch_issued"], counts["prefetch_used"], counts["prefetch_declined"]) == (1, 1, 1)


def test_a_prompt_is_one_step_staged_once_and_released_after_its_last_token():
    # 3 prompt tokens then 1 decode token; 3 layers, top-1 of 4; 1 HOT + 1 STAGE slot.
    # Layer 0 routes expert 0 (fills HOT), layer 1 expert 0 (uid 4: no room, served from the host),
    # layer 2 expert 3 (uid 11), which the predictor names for every token.
    ids = np.array([[[0], [0], [3]]] * 4, dtype=np.int16)
    trace = RoutingTrace(ids, 4, seq_id=np.zeros(4, np.int32), is_prefill=np.array([True, True, True, False]))
    predictions = np.full((4, 3, 1), 3)
    steps = []
    policy = MiraPolicy(2, 12, CacheConfig(), stage_slots=1)
    policy.end_step = steps.append
    counts = replay(trace, policy, check=True, predictions=predictions)
    assert steps == [3, 1]  # one step per forward pass, as the runtime reports them
    # uid 11: staged once for the prompt, served to its three tokens from STAGE, released after the
    # third; staged again for the decode step
    assert (counts["prefetch_issued"], counts["prefetch_used"], counts["hits_stage"]) == (2, 2, 4)
    assert (counts["misses"], counts["hits_hot"]) == (1 + 4, 3)  # uid 0 once; uid 4 at every token


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


def test_book_hand_worked_cap_skip_decline_use_waste():
    policy = MiraPolicy(capacity=3, total_experts=100, config=CacheConfig(), stage_slots=2)
    policy.begin_group()
    policy.access(50, 1)  # a miss fills HOT (1 slot)
    book, copied = PrefetchBook(per_layer=2), []
    book.stage(policy, target_layer=7, uids=[50, 70, 71], admit=lambda uid, access: copied.append(uid))
    assert copied == [70]  # the best two: 50 resident (skipped), 70 copied; 71 is third
    book.stage(policy, target_layer=7, uids=[70, 71], admit=lambda uid, access: copied.append(uid))
    assert copied == [70, 71]  # 70 already staged for layer 7: no second copy
    book.stage(policy, target_layer=8, uids=[80], admit=lambda uid, access: copied.append(uid))
    assert copied == [70, 71]  # STAGE holds two experts waiting for layer 7: declined
    released = book.after_layer(policy, 7, routed=[71, 72])
    assert released == [70, 71]  # the used one and the wasted one, reclaimed right after the layer
    assert book.counts.as_dict() == {"issued": 2, "skipped": 1, "declined": 1, "used": 1, "wasted": 1}
    assert policy.resident() == {50}
