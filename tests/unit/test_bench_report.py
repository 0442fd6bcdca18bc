"""The bench table's columns and sections for the CPU's share of the misses, from hand-made rows."""

from mira.bench.report import cpu_share_configs, cpu_share_lines, format_table, share_off_lines
from mira.cache.costmodel import HybridCosts, LinearCost


def test_the_table_shows_cpu_tokens_the_hybrid_bound_and_each_layers_predicted_and_measured_times():
    layers = [{"layer": 0, "calls": 4, "experts": 4, "tokens": 4, "measured_ms": 2.0, "predicted_ms": 1.8,
               "predicted_cpu_ms": 1.5, "predicted_over_measured": 0.9, "cpu_compute_ms": 1.7, "device_ms": 2.4,
               "predicted_over_served": 0.75},
              {"layer": 1, "calls": 2, "experts": 2, "tokens": 2, "measured_ms": 3.0}]  # no prediction: left out
    row = {"config": "mira-cpu-all", "budget": "8GiB", "num_beams": 1, "slots": 10, "ttft_s": 0.1,
           "decode_tokens_per_s": 9.0, "e2e_tokens_per_s": 8.0, "tokens_served": {"hot": 90, "stage": 0, "miss": 10},
           "pcie_gb": 1.0, "bound": {"bound_tokens_per_s": 50.0, "hybrid_bound_tokens_per_s": 75.0},
           "achieved_over_bound": 5.5, "cpu_tokens": 6, "cpu_experts": {"mode": "all", "layers": layers, "jobs": [
               {"whole_experts": "0", "cut_share": "0.0-0.2", "jobs": 3, "calibrated_ms": 1.0, "measured_ms": 2.5,
                "measured_over_calibrated": 2.5, "compute_ms": 2.1},
               {"whole_experts": "1", "cut_share": None, "jobs": 1, "calibrated_ms": 3.0, "measured_ms": 3.9,
                "measured_over_calibrated": 1.3}]},
           "repeats": [{"decode_tokens_per_s": 9.5, "cpu_experts": 1234, "cpu_cuts": 56, "cpu_compute_ms_per_expert": 3.25,
                        "host_cpu_stolen": 0.0},
                       {"decode_tokens_per_s": 9.0, "cpu_experts": 1200, "cpu_compute_ms_per_expert": None,
                        "cpu_pace": 1.4412, "cpu_cut_pace": 2.2, "device_pace": 1.1749, "host_cpu_stolen": 0.0613}]}
    gpu = {**row, "config": "mira", "cpu_tokens": 0, "cpu_experts": {"mode": "off"}, "decode_tokens_per_s": 6.0,
           "bound": {"bound_tokens_per_s": 50.0}, "repeats": [{"decode_tokens_per_s": 6.0}]}
    result = {"model": "m", "routing": "synthetic", "prompt_set": "fixed", "machine": "here", "runs": [row, gpu]}
    lines = format_table(result).splitlines()
    header = lines[1].split()
    assert header[-5:] == ["CPU", "tokens", "hybrid", "bound", "tok/s"]
    assert lines[2].split()[-2:] == ["6", "75"] and lines[3].split()[-1] == "0"  # no hybrid bound without costs
    at = lines.index("mira-cpu-all at 8GiB: predicted and measured ms per MoE layer call with a CPU share (over "
                     "every run of the configuration)")
    assert lines[at + 2].split() == ["0", "4", "4", "1.800", "1.500", "2.000", "1.7", "0.9", "2.4", "0.75"]
    jobs = lines.index("mira-cpu-all at 8GiB: the CPU's side of the decode jobs a pace learnt from, calibrated "
                       "against measured, by kind")
    assert jobs == at + 4 and lines[jobs + 1].split()[0] == "whole"
    assert lines[jobs + 2].split() == ["0", "0.0-0.2", "3", "1.000", "2.500", "2.500", "2.1"]
    assert lines[jobs + 3].split() == ["1", "-", "1", "3.000", "3.900", "1.300"]  # an older result: no compute
    assert len(lines) == jobs + 4
    row["cpu_experts"]["covers"] = "timed runs"  # what mira bench writes now (run_mira)
    assert ("mira-cpu-all at 8GiB: predicted and measured ms per MoE layer call with a CPU share (over the timed runs "
            "of the configuration)") in format_table(result).splitlines()
    compared = lines.index("the CPU's share against GPU-only mira in the same run:")
    assert lines[compared + 1] == "8GiB: mira-cpu-all 9 tokens/s, 1.500x mira (GPU only), 0.180x the caching bound"
    assert lines[compared + 2] == "  repeat 1: 9.5 tokens/s, 1,234 experts on the CPU and 56 in part at 3.25 ms each"
    assert lines[compared + 3] == ("  repeat 2: 9 tokens/s, 1,200 experts on the CPU, the CPU's side priced at 1.44x "
                                   "its calibration (2.2x with a cut), the device's side at 1.17x, 6.1% of the "
                                   "host's CPU stolen")


def test_mira_is_set_against_mira_gpu_where_both_ran_and_older_results_keep_their_names():
    def row(config, speed):
        return {"config": config, "budget": "12GiB", "num_beams": 1, "decode_tokens_per_s": speed, "runs": 1,
                "bound": {"bound_tokens_per_s": 10.0}}

    def compared(*rows):
        lines = cpu_share_lines({"runs": list(rows)})
        assert lines[:2] == ["", "the CPU's share against GPU-only mira in the same run:"]
        return lines[2:]

    # since --cpu-experts auto is generate's default, `mira` may share its misses and mira-gpu never does
    assert compared(row("mira", 7.5), row("mira-gpu", 5.0), row("static", 4.0)) == [
        "12GiB: mira 7.5 tokens/s, 1.500x mira-gpu (GPU only), 0.750x the caching bound"]
    dropped = {**row("mira", 5.1), "cpu_experts": {"mode": "split", "review": {
        "after_decode_steps": 16, "paced_saving_ms": 0.637, "kept": False}}}
    assert compared(dropped, row("mira-gpu", 5.0)) == [
        "12GiB: mira 5.1 tokens/s, 1.020x mira-gpu (GPU only), 0.510x the caching bound; the share dropped after 16 "
        "decode steps, priced to save 0.637 ms a layer"]
    both = {"runs": [row("mira", 7.5), row("mira-gpu", 5.0)]}
    assert cpu_share_configs(both) == ("mira-gpu", ("mira", "mira-cpu-split", "mira-cpu-all", "mira-cpu-graph",
                                                    "mira-cpu-graph-1", "mira-cut-any"))
    assert compared(row("mira-cut-any", 8.0), row("mira-gpu", 5.0)) == [
        "12GiB: mira-cut-any 8 tokens/s, 1.600x mira-gpu (GPU only), 0.800x the caching bound"]
    # before, `mira` was GPU-only and mira-cpu-auto had the calibrated split
    assert compared(row("mira-cpu-auto", 6.0), row("mira", 5.0)) == [
        "12GiB: mira-cpu-auto 6 tokens/s, 1.200x mira (GPU only), 0.600x the caching bound"]


def test_a_run_whose_calibration_left_autos_share_off_says_what_it_priced():
    """5 ms for a CPU expert (4 fixed + 1 per token) against 2 ms for 100 MB at 50 GB/s: a slow
    calibration shows beside the figures it shaped; a share switched off by its setting says nothing."""
    costs = HybridCosts(blob_bytes=100_000_000, cpu=LinearCost(4e-3, 1e-3), cpu_call_s=2e-4,
                        pcie_bytes_per_s=50e9, pcie_latency_s=0.0, gpu=LinearCost(1e-4, 1e-5))
    off = {"config": "mira", "budget": "25%", "decode_tokens_per_s": 5.5,
           "cpu_experts": {"mode": "off", "calibration": costs.to_json()}}
    unset = {"config": "mira-gpu", "budget": "25%", "decode_tokens_per_s": 5.0, "cpu_experts": {"mode": "off"}}
    on = {"config": "static", "budget": "25%", "decode_tokens_per_s": 6.0,
          "cpu_experts": {"mode": "split", "calibration": costs.to_json()}}
    lfu = {**off, "config": "lfu"}
    assert share_off_lines({"runs": [off, unset, on, lfu, {**off, "budget": "50%"}]}) == [
        "", "25%: the CPU's share stayed off in mira, lfu: calibrated, a CPU expert at one token 5 ms against its read "
        "over PCIe 2 ms", "50%: the CPU's share stayed off in mira: calibrated, a CPU expert at one token 5 ms against "
        "its read over PCIe 2 ms"]
    assert share_off_lines({"runs": [unset, on]}) == []


def test_a_skipped_row_is_marked_without_widening_the_other_rows_columns():
    row = {"config": "mira", "budget": "25%", "num_beams": 1, "slots": 10, "ttft_s": 0.125,
           "decode_tokens_per_s": 9.0, "e2e_tokens_per_s": 8.0, "repeats": [{"decode_tokens_per_s": 9.0}]}
    skipped = {"config": "lru", "budget": "25%", "skipped": "the budget of 1.00 MiB is below the 17.87 MiB needed " * 2}
    result = {"model": "m", "routing": "synthetic", "prompt_set": "fixed", "machine": "here", "runs": [row]}
    alone = format_table(result).splitlines()
    both = format_table({**result, "runs": [row, skipped]}).splitlines()
    assert both[:3] == alone[:3]  # title, header and the measured row, column for column
    assert both[3].split() == ["25%", "lru", "skipped"] and "below" not in format_table({**result, "runs": [skipped, row]})


def test_the_cpu_share_runs_where_a_configuration_can_have_it():
    from mira.bench.command import _cpu_share_runs

    on_cuda = [name for name in ("mira", "mira-gpu", "mira-lagged", "mira+p-lagged", "mira-cpu-all", "lru", "hf-gpu")
               if _cpu_share_runs(name, "cuda")]
    assert on_cuda == ["mira", "mira-cpu-all", "lru"]  # lru's share is auto, as mira's
    assert [name for name in ("mira", "mira-cpu-all", "mira-cpu-graph", "mira-cpu-split")
            if _cpu_share_runs(name, "cpu")] == ["mira-cpu-all", "mira-cpu-graph"]
