"""Predictor features (paper IV-E): routed mass, top-K marks, the routing history, the features file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mira.errors import MiraError
from mira.predict.features import (FeatureSet, RoutingHistory, features_path, history, routed_mass, step_counts,
                                   top_mask)
from mira.store.trace import RoutingTrace


def test_routed_mass_is_the_share_of_routed_slots_per_expert():
    index = torch.tensor([[0, 2], [2, 3], [2, 0]])  # 3 tokens, top-2 of 5
    out = torch.full((5,), 7.0)  # stale values: overwritten
    assert routed_mass(index, out, torch.ones(1)) is out
    assert out.tolist() == pytest.approx([2 / 6, 0, 3 / 6, 1 / 6, 0])


def test_top_mask_marks_the_k_largest_with_ties_to_the_lower_id():
    mass = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.25, 0.25, 0.25, 0.25]])
    assert top_mask(mass, 2).tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    assert top_mask(mass, 1).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_history_averages_the_previous_steps_of_a_layer_only():
    history_state = RoutingHistory(num_layers=2, num_experts=3, window=2, device="cpu")
    assert history_state.recent(1).tolist() == [0, 0, 0]  # nothing observed yet
    history_state.observe(1, torch.tensor([1.0, 0, 0]))
    history_state.observe(0, torch.tensor([0, 0, 1.0]))
    assert history_state.recent(1).tolist() == [1, 0, 0]
    history_state.observe(1, torch.tensor([0, 1.0, 0]))
    assert history_state.recent(1).tolist() == [0.5, 0.5, 0]
    history_state.observe(1, torch.tensor([0, 0, 1.0]))  # the first step leaves the window of 2
    assert history_state.recent(1).tolist() == [0, 0.5, 0.5]
    assert history_state.recent(0).tolist() == [0, 0, 1]


@settings(max_examples=30, deadline=None)
@given(steps=st.integers(1, 12), window=st.integers(1, 5), seed=st.integers(0, 1000))
def test_offline_history_equals_the_runtime_state_step_by_step(steps, window, seed):
    mass = np.random.default_rng(seed).dirichlet(np.ones(4), size=(steps, 3)).astype(np.float32)  # [S, L, E]
    state = RoutingHistory(3, 4, window, "cpu")
    offline = history(mass, window)
    for step in range(steps):
        for layer in range(3):
            np.testing.assert_allclose(state.recent(layer).numpy(), offline[step, layer], atol=1e-6)
            state.observe(layer, torch.from_numpy(mass[step, layer]))


def _trace_and_features() -> tuple[RoutingTrace, FeatureSet]:
    # 2 steps: a prompt of 2 tokens, then 1 token; 3 MoE layers, top-2 of 4 experts, hidden 5
    ids = np.array([[[0, 1], [2, 3], [0, 3]], [[1, 0], [3, 2], [1, 2]], [[2, 3], [0, 1], [0, 1]]], dtype=np.int16)
    trace = RoutingTrace(ids, 4, seq_id=np.zeros(3, np.int32), is_prefill=np.array([True, True, False]))
    step_start = np.array([0, 2, 3])
    rng = np.random.default_rng(0)
    features = FeatureSet(step_start, rng.normal(size=(2, 3, 5)).astype(np.float16),
                          rng.normal(size=(2, 3, 4)).astype(np.float32), step_counts(trace, step_start),
                          rng.random((2, 1, 4)).astype(np.float32), top_k=2, fingerprint="abc")
    return trace, features


def test_step_counts_and_targets_come_from_the_trace():
    trace, features = _trace_and_features()
    assert features.routed[0, 0].tolist() == [2, 2, 0, 0]  # tokens 0, 1 at layer 0
    assert features.routed[1, 2].tolist() == [1, 1, 0, 0]
    assert features.targets()[:, 0].tolist() == [[0.25] * 4, [0.5, 0.5, 0, 0]]  # layer 2
    inputs = features.inputs(window=4)
    assert inputs.hidden.shape == (2, 1, 5) and inputs.speculation.shape == (2, 1, 4)
    assert inputs.history[:, 0].tolist() == [[0, 0, 0, 0], [0.25] * 4]  # layer 2 of the step before
    assert inputs.top[0, 0].tolist() == [1, 1, 0, 0]


def test_features_round_trip_and_refuse_another_trace(tmp_path):
    trace, features = _trace_and_features()
    path = features_path(tmp_path / "run.npz")
    assert path.name == "run.features.npz"
    features.save(path)
    loaded = FeatureSet.load(path)
    assert loaded.fingerprint == "abc" and loaded.top_k == 2
    for name in ("step_start", "hidden", "logits", "routed", "speculation"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(features, name))
    loaded.check(trace)
    other = RoutingTrace(np.ascontiguousarray(trace.topk_ids[::-1]), 4)
    with pytest.raises(MiraError, match="do not match the routing.*mira trace --features"):
        loaded.check(other)
    with pytest.raises(MiraError, match="cover 3 tokens"):
        loaded.check(RoutingTrace(trace.topk_ids[:2], 4))
    with pytest.raises(MiraError, match="no predictor features.*mira trace --features --out gone.npz"):
        FeatureSet.load(features_path(tmp_path / "gone.npz"))
    assert [p.name for p in tmp_path.iterdir()] == ["run.features.npz"]  # no temporary left behind
