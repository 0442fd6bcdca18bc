"""Routing traces (DESIGN.md 5): save/load round trip, validation errors, replay order."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mira.errors import MiraError
from mira.store.trace import RoutingTrace, TraceError


def _trace(ids, num_experts=4, **optional) -> RoutingTrace:
    return RoutingTrace(np.asarray(ids, dtype=np.int16), num_experts, **optional)


def _full_trace() -> RoutingTrace:
    ids = np.array([[[1, 0], [2, 3]], [[0, 1], [3, 3]], [[2, 1], [0, 2]]], dtype=np.int16)  # [T=3, L=2, K=2]
    return RoutingTrace(
        ids,
        4,
        topk_weights=np.linspace(0, 1, ids.size, dtype=np.float16).reshape(ids.shape),
        seq_id=np.array([0, 0, 1], dtype=np.int32),
        is_prefill=np.array([True, False, True]),
    )


@st.composite
def traces(draw) -> RoutingTrace:
    tokens, layers = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    experts = draw(st.integers(1, 5))
    top_k = draw(st.integers(1, 3))
    size = tokens * layers * top_k
    ids = draw(st.lists(st.integers(0, experts - 1), min_size=size, max_size=size))
    return _trace(np.array(ids).reshape(tokens, layers, top_k), experts)


def test_save_load_round_trip_keeps_every_array(tmp_path):
    trace = _full_trace()
    path = tmp_path / "t.npz"
    trace.save(path)
    loaded = RoutingTrace.load(path)
    assert loaded.num_experts == 4
    assert loaded.source == str(path)
    for name in ("topk_ids", "topk_weights", "seq_id", "is_prefill"):
        original, copy = getattr(trace, name), getattr(loaded, name)
        assert copy.dtype == original.dtype
        np.testing.assert_array_equal(copy, original)


def test_round_trip_without_optional_arrays_leaves_them_none(tmp_path):
    _trace([[[1, 2]]]).save(tmp_path / "t.npz")
    loaded = RoutingTrace.load(tmp_path / "t.npz")
    assert loaded.topk_weights is None and loaded.seq_id is None and loaded.is_prefill is None


def test_save_replaces_an_existing_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "t.npz"
    _trace([[[1]]]).save(path)
    _trace([[[3]]]).save(path)
    assert RoutingTrace.load(path).topk_ids.item() == 3
    assert os.listdir(tmp_path) == ["t.npz"]


def test_failed_save_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "t.npz"
    _trace([[[1]]]).save(path)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", fail)
    with pytest.raises(OSError, match="disk full"):
        _trace([[[3]]]).save(path)
    monkeypatch.undo()
    assert RoutingTrace.load(path).topk_ids.item() == 1
    assert os.listdir(tmp_path) == ["t.npz"]


@pytest.mark.parametrize(
    ("ids", "num_experts", "optional", "message"),
    [
        (np.zeros((1, 1, 1), np.int32), 4, {}, "topk_ids must be int16, got int32"),
        (np.zeros((2, 2), np.int16), 4, {}, r"topk_ids must have shape \[tokens, layers, top_k\], got shape \(2, 2\)"),
        (np.zeros((0, 2, 2), np.int16), 4, {}, "topk_ids has an empty dimension"),
        (np.full((1, 1, 2), 9, np.int16), 8, {}, "topk_ids has ids up to 9 but num_experts is 8"),
        (np.full((1, 1, 2), -1, np.int16), 8, {}, r"topk_ids has negative ids \(down to -1\)"),
        (np.zeros((1, 1, 1), np.int16), 0, {}, "num_experts must be between 1 and 32768, got 0"),
        (np.zeros((1, 1, 2), np.int16), 4, {"topk_weights": np.zeros((1, 1, 2), np.float32)},
         "topk_weights must be float16, got float32"),
        (np.zeros((1, 1, 2), np.int16), 4, {"topk_weights": np.zeros((1, 1, 3), np.float16)},
         r"topk_weights must have shape \(1, 1, 2\) to match topk_ids, got \(1, 1, 3\)"),
        (np.zeros((2, 1, 1), np.int16), 4, {"seq_id": np.zeros(3, np.int32)},
         r"seq_id must have shape \(2,\) to match topk_ids, got \(3,\)"),
        (np.zeros((2, 1, 1), np.int16), 4, {"seq_id": [0, 0]}, "seq_id must be int32, got list"),
        (np.zeros((2, 1, 1), np.int16), 4, {"is_prefill": np.zeros(2, np.int8)}, "is_prefill must be bool, got int8"),
    ],
)
def test_invalid_arrays_are_refused_with_the_problem_named(ids, num_experts, optional, message):
    with pytest.raises(TraceError, match=message):
        RoutingTrace(ids, num_experts, **optional)


def test_load_names_the_file_in_errors(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, topk_ids=np.full((1, 1, 1), 9, np.int16), num_experts=np.int64(8))
    with pytest.raises(TraceError, match=f"trace {path}: topk_ids has ids up to 9 but num_experts is 8"):
        RoutingTrace.load(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"num_experts": np.int64(8)}, "missing array 'topk_ids'"),
        ({"topk_ids": np.zeros((1, 1, 1), np.int16)}, "missing array 'num_experts'"),
        ({"topk_ids": np.zeros((1, 1, 1), np.int16), "num_experts": np.array([8, 8])},
         "num_experts must be one integer"),
        ({"topk_ids": np.zeros((1, 1, 1), np.int16), "num_experts": np.float32(8)}, "num_experts must be one integer"),
    ],
)
def test_load_refuses_missing_or_malformed_arrays(tmp_path, arrays, message):
    path = tmp_path / "t.npz"
    np.savez(path, **arrays)
    with pytest.raises(TraceError, match=message):
        RoutingTrace.load(path)


def test_load_refuses_a_file_that_is_not_an_npz(tmp_path):
    text = tmp_path / "t.npz"
    text.write_text("not a trace")
    with pytest.raises(TraceError, match=r"not a readable .npz file \(neither a zip archive nor an .npy array\)"):
        RoutingTrace.load(text)
    truncated = tmp_path / "truncated.npz"
    np.savez(truncated, topk_ids=np.zeros((2, 1, 1)))
    truncated.write_bytes(truncated.read_bytes()[:40])  # a zip's header, then nothing
    with pytest.raises(TraceError, match="not a readable .npz file"):
        RoutingTrace.load(truncated)
    with pytest.raises(TraceError, match="cannot read it .* pass an .npz file"):
        RoutingTrace.load(tmp_path)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(TraceError, match="a single .npy array"):
        RoutingTrace.load(single)
    with pytest.raises(FileNotFoundError):
        RoutingTrace.load(tmp_path / "missing.npz")


def test_trace_errors_are_user_facing_mira_errors():
    with pytest.raises(MiraError):
        _trace([[[5]]], num_experts=4)


def test_extra_arrays_in_the_file_are_ignored(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, topk_ids=np.ones((1, 1, 1), np.int16), num_experts=np.int64(2), features=np.zeros(7))
    assert RoutingTrace.load(path).topk_ids.item() == 1


def test_accesses_follow_token_then_layer_then_ascending_id_with_counts():
    trace = _trace([[[2, 0], [3, 3]], [[1, 2], [0, 3]]], num_experts=4)  # [T=2, L=2, K=2]
    groups = [(group.token, group.layer, group.experts) for group in trace.accesses()]
    assert groups == [
        (0, 0, ((0, 1), (2, 1))),
        (0, 1, ((7, 2),)),  # layer 1, expert 3 routed twice: uid 1 * 4 + 3, one access of 2 tokens
        (1, 0, ((1, 1), (2, 1))),
        (1, 1, ((4, 1), (7, 1))),
    ]
    np.testing.assert_array_equal(trace.uid_sequence(), [0, 2, 7, 1, 2, 4, 7])
    np.testing.assert_array_equal(trace.expert_counts(), [1, 1, 2, 0, 1, 0, 0, 3])


@settings(max_examples=60, deadline=None)
@given(traces())
def test_uid_sequence_and_counts_agree_with_accesses(trace):
    groups = list(trace.accesses())
    flat = [uid for group in groups for uid, _ in group.experts]
    np.testing.assert_array_equal(trace.uid_sequence(), flat)
    assert len(groups) == trace.num_tokens * trace.num_layers
    counts = np.zeros(trace.num_uids, dtype=np.int64)
    for group in groups:
        assert [uid for uid, _ in group.experts] == sorted({uid for uid, _ in group.experts})
        for uid, tokens in group.experts:
            assert uid // trace.num_experts == group.layer
            counts[uid] += tokens
    np.testing.assert_array_equal(counts, trace.expert_counts())
    assert counts.sum() == trace.topk_ids.size
