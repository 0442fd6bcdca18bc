"""How much decode routing changes from step to step (mira.bench.variety), on hand-worked traces."""

import numpy as np
import pytest

from mira.bench.variety import decode_route_changes
from mira.store.trace import RoutingTrace


def _trace(steps: list[list[list[int]]], seq: list[int], prefill: list[bool]) -> RoutingTrace:
    return RoutingTrace(np.array(steps, dtype=np.int16), 4, seq_id=np.array(seq, dtype=np.int32),
                        is_prefill=np.array(prefill))


def test_changes_are_counted_per_layer_between_consecutive_steps_of_one_sequence():
    # E = 4, K = 2, two layers; sequence 0: a prompt token then two decode steps; sequence 1: the same
    steps = [
        [[0, 1], [0, 2]],  # seq 0, prompt
        [[1, 0], [1, 3]],  # decode: layer 0 the same set (order ignored), layer 1 changed
        [[2, 3], [1, 3]],  # decode: layer 0 changed, layer 1 the same
        [[2, 3], [3, 1]],  # seq 1, prompt: not compared with seq 0's last step
        [[2, 3], [0, 1]],  # decode: layer 0 the same, layer 1 changed
    ]
    result = decode_route_changes(_trace(steps, [0, 0, 0, 1, 1], [True, False, False, True, False]))
    assert result["value"] == 0.5  # 3 of the 6 (step, layer) pairs changed
    assert result["uniform"] == round(1 - 1 / 6, 3)  # C(4, 2) = 6 sets
    assert result["low"] is False


def test_routing_that_never_changes_is_low():
    steps = [[[0, 1]], [[0, 1]], [[1, 0]], [[0, 1]]]
    result = decode_route_changes(_trace(steps, [0, 0, 0, 0], [True, False, False, False]))
    assert result["value"] == 0.0 and result["low"] is True


def test_a_trace_without_sequences_is_refused():
    with pytest.raises(ValueError, match="seq_id and is_prefill"):
        decode_route_changes(RoutingTrace(np.zeros((2, 1, 2), dtype=np.int16), 4))


def test_the_bench_table_says_when_a_run_s_routing_barely_changes():
    from mira.bench.report import format_table

    row = {"config": "mira", "budget": "8GiB", "num_beams": 1, "slots": 10, "ttft_s": 0.1, "decode_tokens_per_s": 9.0,
           "e2e_tokens_per_s": 8.0, "tokens_served": {"hot": 90, "stage": 0, "miss": 10}, "pcie_gb": 1.0,
           "bound": {"bound_tokens_per_s": 50.0}, "achieved_over_bound": 5.5,
           "decode_route_changes": {"value": 0.05, "uniform": 0.964, "low": True}}
    result = {"model": "m", "routing": "synthetic", "prompt_set": "fixed", "machine": "here", "runs": [row]}
    assert "routing barely changes" in format_table(result)
    row["decode_route_changes"] = {"value": 0.9, "uniform": 0.964, "low": False}
    assert "routing barely changes" not in format_table(result)
