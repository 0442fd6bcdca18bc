"""Predictive staging (paper IV-E) as the simulator models the runtime's (mira.cache.staging):
one expert per target layer and step, in a stage row outside the policy's slots."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mira.bench.simulate import replay, simulate
from mira.cache.config import CacheConfig
from mira.cache.policy import MiraPolicy
from mira.store.trace import RoutingTrace
from test_simulate import ONLINE, routing


@settings(max_examples=150, deadline=None)
@given(routing(), st.sampled_from(ONLINE), st.integers(0, 2**32 - 1))
def test_prefetching_keeps_the_mechanism_contract_and_its_counts_add_up(case, policy, seed):
    trace, slots, config, stage_slots = case
    rng = np.random.default_rng(seed)
    prompt = int(rng.integers(0, trace.num_tokens + 1))  # the first tokens are one prompt step
    trace = RoutingTrace(trace.topk_ids, trace.num_experts, seq_id=np.zeros(trace.num_tokens, np.int32),
                         is_prefill=np.arange(trace.num_tokens) < prompt)
    predictions = rng.integers(-1, trace.num_experts, size=(*trace.topk_ids.shape[:2], 3))
    result = simulate(trace, policy, slots, stage_slots=stage_slots, config=config, check=True,
                      predictions=predictions)
    assert result["prefetch_used"] + result["prefetch_wasted"] == result["prefetch_issued"]
    assert result["hits"] + result["misses"] == result["accesses"]
    assert result["copies"] == result["misses"] + result["prefetch_issued"] + result["prefetch_admitted"]
    steps = 1 + (trace.num_tokens - prompt) if prompt else trace.num_tokens
    assert result["prefetch_issued"] <= steps * max(trace.num_layers - 2, 0)  # one per target layer and step
    # Fetching ahead never moves fewer blobs than Belady's optimum (with bypass, from the best start) at
    # the same slot count plus the stage rows: any schedule can fetch each blob lazily, at its use,
    # without more copies.
    assert simulate(trace, "belady", slots + 3)["misses"] <= result["copies"]


def test_a_staged_expert_is_served_from_stage_once_per_step_and_the_policy_still_sees_a_miss():
    # 3 prompt tokens then 1 decode token; 3 layers, top-1 of 4; 1 HOT + 1 STAGE slot. Layer 0
    # routes expert 0 (uid 0), layer 1 expert 0 (uid 4), layer 2 expert 3 (uid 11), which the
    # predictor names for every token. Without prefetching uid 0 and uid 4 are admitted at their
    # first miss and hit after, and uid 11 misses at all 4 tokens: the policy has no slot left.
    ids = np.array([[[0], [0], [3]]] * 4, dtype=np.int16)
    trace = RoutingTrace(ids, 4, seq_id=np.zeros(4, np.int32), is_prefill=np.array([True, True, True, False]))
    steps = []
    policy = MiraPolicy(2, 12, CacheConfig(), stage_slots=1)
    policy.end_step = steps.append
    on = replay(trace, policy, check=True, predictions=np.full((4, 3, 1), 3))
    off = replay(trace, MiraPolicy(2, 12, CacheConfig(), stage_slots=1), check=True)
    assert steps == [3, 1]  # one step per forward pass, as the runtime reports them
    assert (off["misses"], off["admissions"], off["tokens_miss"]) == (6, 2, 6)
    # uid 11 is staged once per step (the prompt, then the decode step) and read from its stage row
    # by all 4 tokens; the policy decides as without prefetching
    assert (on["prefetch_issued"], on["prefetch_used"], on["prefetch_wasted"]) == (2, 2, 0)
    assert on["misses"] == off["misses"] - 4 and on["hits_stage"] == off["hits_stage"] + 4
    assert on["admissions"] == off["admissions"] and on["hits_hot"] == off["hits_hot"]


def test_a_resident_expert_is_never_staged_and_a_wrong_prediction_is_wasted():
    ids = np.array([[[0], [0], [1]], [[0], [0], [1]]], dtype=np.int16)  # 2 tokens, 3 layers, top-1 of 2
    trace = RoutingTrace(ids, num_experts=2)
    wrong = np.zeros((2, 3, 1), dtype=np.int64)  # layer 2's expert 0 predicted; expert 1 is routed
    counts = replay(trace, MiraPolicy(0, 6, CacheConfig()), check=True, predictions=wrong)
    assert (counts["prefetch_issued"], counts["prefetch_used"], counts["prefetch_wasted"]) == (2, 0, 2)
    everything = MiraPolicy(6, 6, CacheConfig(), prior=None)
    counts = replay(trace, everything, check=True, predictions=np.ones((2, 3, 1), dtype=np.int64))
    assert counts["prefetch_issued"] == 0 or counts["prefetch_used"] <= counts["prefetch_issued"]


def test_perfect_predictions_remove_the_misses_of_predicted_layers():
    # 2 experts per layer, 4 layers, top-1, alternating every token: HOT (1 slot) cannot keep up.
    ids = np.array([[[t % 2]] * 4 for t in range(40)], dtype=np.int16)
    trace = RoutingTrace(ids, num_experts=2)
    config = CacheConfig()
    off = simulate(trace, "mira", 4, stage_slots=3, config=config)
    on = simulate(trace, "mira", 4, stage_slots=3, config=config, predictions=ids.astype(np.int64))
    assert on["misses"] < off["misses"]
    assert on["prefetch_used"] == on["prefetch_issued"] and on["prefetch_wasted"] == 0
