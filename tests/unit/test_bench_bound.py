"""The decode bound of DESIGN.md 4 (mira.bench.bound) and the goal figures of `mira bench`."""

from __future__ import annotations

import numpy as np
import pytest

from mira.bench.bound import decode_bound
from mira.kernels.machine import Machine
from mira.bench.run import compare, compare_schemes
from mira.store.trace import RoutingTrace


def _trace() -> RoutingTrace:
    """Two sequences over 2 MoE layers of 4 experts, top-2: prompt 2 + 2 decode tokens, prompt 1 + 1."""
    ids = np.array([
        [[0, 1], [2, 3]], [[1, 3], [0, 2]],  # sequence 0, prompt
        [[0, 1], [2, 3]], [[1, 2], [0, 3]],  # sequence 0, decode
        [[2, 3], [1, 2]],  # sequence 1, prompt
        [[1, 0], [3, 2]],  # sequence 1, decode
    ], dtype=np.int16)
    return RoutingTrace(ids, 4, seq_id=np.array([0, 0, 0, 0, 1, 1], dtype=np.int32),
                        is_prefill=np.array([True, True, False, False, True, False]))


def test_decode_bound_by_hand():
    # decode accesses (uid = layer * 4 + expert, each (token, layer) ascending):
    #   0 1 6 7 | 1 2 4 7 | 0 1 6 7; a warm start holds 0 1 6 7 with 4 slots; 2 and 4 are never needed
    #   again, so the optimum bypasses them: 2 misses. With no slot every one of the 12 accesses misses.
    trace = _trace()
    machine = Machine(hbm_bytes_per_s=1000.0, pcie_bytes_per_s=1.0)
    bound = decode_bound(trace, slots=4, blob_bytes=10, weight_bytes=100, kv_bytes_per_token=2, figures=machine)
    # 3 decode steps x 100 weight bytes + 12 experts x 10 + KV of contexts 3, 4 and 2 tokens x 2 bytes
    assert bound["hbm_bytes"] == 300 + 120 + 18
    assert bound["belady_misses"] == 2 and bound["pcie_bytes"] == 20
    assert bound["bound_s"] == pytest.approx(20.0) and bound["bound_by"] == "PCIe"  # 20 B at 1 B/s > 438 B at 1 kB/s
    assert bound["bound_tokens_per_s"] == pytest.approx(3 / 20)
    no_slots = decode_bound(trace, 0, 10, 100, 2, Machine(hbm_bytes_per_s=1.0, pcie_bytes_per_s=1000.0))
    assert no_slots["belady_misses"] == 12 and no_slots["bound_by"] == "HBM"
    assert no_slots["bound_s_per_step"] == pytest.approx(438 / 3)


def test_the_hybrid_bound_reads_the_misses_over_pcie_and_by_the_cpu_at_once():
    # as above: 2 Belady misses of 10 bytes; PCIe 1 B/s and the CPU 3 B/s read them at 4 B/s together
    machine = Machine(hbm_bytes_per_s=1000.0, pcie_bytes_per_s=1.0)
    bound = decode_bound(_trace(), 4, 10, 100, 2, machine, cpu_bytes_per_s=3.0)
    assert bound["bound_s"] == pytest.approx(20.0)  # the caching bound is unchanged
    assert bound["hybrid_bound_s"] == pytest.approx(5.0) and bound["hybrid_bound_tokens_per_s"] == pytest.approx(3 / 5)
    fast_cpu = decode_bound(_trace(), 4, 10, 100, 2, machine, cpu_bytes_per_s=1e6)
    assert fast_cpu["hybrid_bound_s"] == pytest.approx(0.438)  # then HBM binds: 438 B at 1 kB/s
    assert "hybrid_bound_s" not in decode_bound(_trace(), 4, 10, 100, 2, machine)


def test_decode_bound_needs_decode_steps_and_sequence_ids():
    trace = _trace()
    prompt_only = RoutingTrace(trace.topk_ids[:2], 4, seq_id=trace.seq_id[:2], is_prefill=trace.is_prefill[:2])
    with pytest.raises(ValueError, match="no decode steps"):
        decode_bound(prompt_only, 4, 10, 100, 2)
    with pytest.raises(ValueError, match="seq_id"):
        decode_bound(RoutingTrace(trace.topk_ids, 4), 4, 10, 100, 2)


def _row(config, budget, decode, ttft=1.0, nbytes=0, **extra):
    return {"config": config, "budget": budget, "budget_bytes": nbytes, "decode_tokens_per_s": decode,
            "ttft_s": ttft, **extra}


def test_mira_is_compared_with_the_fastest_baseline_of_each_budget_ignoring_beams_and_skips():
    rows = [
        _row("mira", "8GiB", 6.0, nbytes=8, achieved_over_bound=1.5),
        _row("lru", "8GiB", 4.0, nbytes=8),
        _row("lru-lagged", "8GiB", 8.0, nbytes=8),  # the faster LRU is the one compared
        _row("lfu", "8GiB", 5.0, nbytes=8),
        _row("mira+p", "8GiB", 50.0, nbytes=8),  # a Mira variant, not a baseline
        _row("lru-lagged", "8GiB", 99.0, nbytes=8, num_beams=2, beam_search=True),
        {"config": "static", "budget": "8GiB", "skipped": "too small"},
        _row("mira", "all", 100.0, nbytes=48),
        _row("hf-gpu", "all", 25.0),
        _row("lru", "24GiB", 10.0, nbytes=24),  # no mira row: no comparison
    ]
    assert compare(rows) == {
        "8GiB": {"mira": 6.0, "best_baseline": "lru-lagged", "best_baseline_tokens_per_s": 8.0,
                 "mira_over_best_baseline": 0.75, "mira_achieved_over_bound": 1.5},
        "all": {"mira": 100.0, "best_baseline": "hf-gpu", "best_baseline_tokens_per_s": 25.0,
                "mira_over_best_baseline": 4.0, "mira_achieved_over_bound": None},
    }


def test_hf_gpu_that_ran_on_the_cpu_is_named_so_in_the_comparison():
    from mira.bench.report import format_table

    rows = [_row("mira", "all", 88.0), _row("hf-gpu", "all", 83.0, device="cpu", dtype="float32")]
    cell = compare(rows)["all"]
    assert cell["best_baseline"] == "hf-gpu" and cell["best_baseline_ran_on"] == "cpu, float32"
    result = {"model": "m", "routing": "real", "prompt_set": "p", "machine": "vm", "runs": rows,
              "comparison": compare(rows)}
    assert "1.060x the fastest baseline (hf-gpu on cpu, float32, 83)" in format_table(result)


def test_with_two_schemes_each_gets_its_own_cells_and_their_ratio_per_budget():
    rows = [
        _row("mira", "12GiB", 4.0, quant="int8-shared", achieved_over_bound=2.0),
        _row("static", "12GiB", 5.0, quant="int8-shared"),
        _row("mira", "12GiB", 7.0, quant="int4", achieved_over_bound=1.25),
        _row("static", "12GiB", 6.0, quant="int4"),
        _row("lru", "24GiB", 3.0, quant="int4"),  # on one scheme only: no ratio
        _row("mira", "24GiB", 8.0, quant="int8-shared"),
        _row("mira", "24GiB", 14.0, quant="int4"),
        _row("mira", "24GiB", 99.0, quant="int4", num_beams=2, beam_search=True),
        _row("hf-gpu", "24GiB", 10.0),  # transformers' weights: a baseline of both schemes
    ]
    assert compare(rows) == {
        "12GiB, int8-shared": {"mira": 4.0, "best_baseline": "static", "best_baseline_tokens_per_s": 5.0,
                               "mira_over_best_baseline": 0.8, "mira_achieved_over_bound": 2.0, "quant": "int8-shared"},
        "12GiB, int4": {"mira": 7.0, "best_baseline": "static", "best_baseline_tokens_per_s": 6.0,
                        "mira_over_best_baseline": 1.167, "mira_achieved_over_bound": 1.25, "quant": "int4"},
        "24GiB, int8-shared": {"mira": 8.0, "best_baseline": "hf-gpu", "best_baseline_tokens_per_s": 10.0,
                               "mira_over_best_baseline": 0.8, "mira_achieved_over_bound": None, "quant": "int8-shared"},
        "24GiB, int4": {"mira": 14.0, "best_baseline": "hf-gpu", "best_baseline_tokens_per_s": 10.0,
                        "mira_over_best_baseline": 1.4, "mira_achieved_over_bound": None, "quant": "int4"},
    }
    assert compare_schemes(rows) == {
        "12GiB": {"mira": {"int8-shared": 4.0, "int4": 7.0, "int4_over_int8-shared": 1.75},
                  "static": {"int8-shared": 5.0, "int4": 6.0, "int4_over_int8-shared": 1.2}},
        "24GiB": {"mira": {"int8-shared": 8.0, "int4": 14.0, "int4_over_int8-shared": 1.75}},
    }
    assert compare_schemes([r for r in rows if r.get("quant") != "int4"]) == {}  # one scheme: nothing to compare
