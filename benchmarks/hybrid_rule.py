"""Auto's rule for the CPU's share, re-priced over committed `mira bench` runs on a GPU.

`--cpu-experts auto` takes the CPU's share of the misses (and with it inline residency) where the
calibrated cost model expects a decode layer's split to save at least INLINE_LAYER_S against PCIe
alone, each routed expert missing with the budget's share of experts without a slot
(mira.cache.costmodel.cpu_pays). It decides once, before decoding. This script re-prices that
expected saving per layer, for every run whose CPU took a share, four ways:

  rule       as auto priced it: calibrated costs, the budget's miss rate (what it decided on)
  measured   calibrated costs, the run's own miss rate (its lookups, prefill included)
  paced      the run's miss rate, the split priced at the paces the run ended with (the CPU's, the
             cut's and the device's), the PCIe-only alternative at the device's pace too (as the
             runtime's splits price it)
  apart      as paced, but the PCIe-only alternative at its calibration: GPU-only decoding has no
             CPU memory traffic beside its copies (mira.cache.costmodel.paced_saving, which auto's
             second judgement applies after its first decode steps, at their own miss rate)

Runs from before the runtime learnt a pace for the device's side and one for cuts are left out. Each
is set beside what the run measured where `mira-gpu` (the same policy, GPU only, lagged) ran
at the same budget in the same run: the decode time per MoE layer that the share saved, net of
running inline. A rule that chose well would put every run that lost below every run that gained.

    python benchmarks/hybrid_rule.py [RESULT.json ...]   # default: every committed bench result
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mira.bench.provenance import result_header
from mira.bench.synthetic import synthetic_config
from mira.cache.costmodel import INLINE_LAYER_S, CpuPace, DevicePace, HybridCosts, cpu_saving, paced_saving
from mira.kernels.cpu_experts import default_column_cost
from mira.kernels.triton_ffn import cut_granule
from mira.kernels.tuning import load_config
from mira.models.loader import routed_per_token
from mira.models.registry import adapter_for
from mira.runtime.hybrid import expert_cuts
from mira.store.layout import ExpertLayout
from mira.store.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PRICINGS = ("rule", "measured", "paced", "apart")


def paced(calibrated: HybridCosts, cpu: float, device: float) -> HybridCosts:
    """The calibrated costs with the CPU's side at pace `cpu` and the device's at `device`."""
    return DevicePace.at(device).costs(CpuPace.at(cpu).costs(calibrated))


def model_of(command: str):
    """The synthetic model's config named by a bench command's --synthetic."""
    words = command.split()
    return synthetic_config(words[words.index("--synthetic") + 1])[0]


def rows_of(result: dict) -> list[dict]:
    """The re-priced savings of every run whose CPU took a share, with the same run's mira-gpu."""
    if "--synthetic" not in result["command"]:
        return []
    config = model_of(result["command"])
    spec = adapter_for(config).spec
    top_k = routed_per_token(config)
    gpu_only = {(r["budget"], r["quant"]): r for r in result["runs"] if r["config"] == "mira-gpu"}
    out = []
    for run in result["runs"]:
        share = run.get("cpu_experts") or {}
        if run["config"] == "mira-gpu" or share.get("mode") != "split" or not share.get("calls") \
                or share.get("device_pace") is None:
            continue  # no share taken, or from before the device's pace (and the cut's) were learnt
        calibrated = HybridCosts.from_json(share["calibration"])
        layout = ExpertLayout(run["quant"], config.hidden_size, spec.intermediate)
        tuning = load_config(result["device"], layout.hidden, layout.intermediate)  # the kernels the run had
        cuts = expert_cuts(layout, cut_granule(tuning, layout.intermediate), default_column_cost(layout.scheme))
        store = result["stores"][run["quant"]]
        total = round((store["all_experts_bytes"] - store["reserve_bytes"]) / store["blob_bytes"])  # experts
        uniform = 1 - min(1.0, run["slots"] / total)
        lookups = run["lookups"]
        measured = lookups["miss"] / sum(lookups.values())
        cpu = paced(calibrated, share["cpu_pace"], share["device_pace"])
        cut = paced(calibrated, share["cpu_cut_pace"], share["device_pace"])
        blob = calibrated.blob_bytes
        saving = {
            "rule": cpu_saving(calibrated, top_k, blob, uniform, cuts),
            "measured": cpu_saving(calibrated, top_k, blob, measured, cuts),
            "paced": cpu_saving(cpu, top_k, blob, measured, cuts, cut_costs=cut),
            "apart": paced_saving(calibrated, CpuPace.at(share["cpu_pace"]), CpuPace.at(share["cpu_cut_pace"]),
                                  DevicePace.at(share["device_pace"]), top_k, blob, measured, cuts),
        }
        row = {"file": None, "config": run["config"], "budget": run["budget"], "quant": run["quant"],
               "miss_rate_budget": round(uniform, 3), "miss_rate_run": round(measured, 3),
               "paces": {k: share[k] for k in ("cpu_pace", "cpu_cut_pace", "device_pace")},
               "saving_ms": {k: round(v * 1e3, 3) for k, v in saving.items()},
               "decode_tokens_per_s": run["decode_tokens_per_s"]}
        other = gpu_only.get((run["budget"], run["quant"]))
        if other is not None and run["config"].startswith("mira"):  # the same policy without the share
            layers = config.num_hidden_layers
            row["mira_gpu_tokens_per_s"] = other["decode_tokens_per_s"]
            row["over_mira_gpu"] = round(run["decode_tokens_per_s"] / other["decode_tokens_per_s"], 3)
            row["net_saved_ms_per_layer"] = round(
                1e3 * (1 / other["decode_tokens_per_s"] - 1 / run["decode_tokens_per_s"]) / layers, 3)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", type=Path, help="mira bench results (default: every committed one)")
    args = parser.parse_args()
    files = args.results or sorted(RESULTS.glob("bench-*.json"))
    rows = []
    for path in files:
        for row in rows_of(json.loads(path.read_text())):
            row["file"] = path.name
            rows.append(row)
    lines = ["| file | config | budget | miss rate: budget / run | paces: CPU / cut / device | "
             + " | ".join(f"{p} ms" for p in PRICINGS) + " | x mira-gpu | net ms/layer |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in PRICINGS) + " | --- | --- |"]
    for row in rows:
        paces = " / ".join(f"{row['paces'][k]:.2f}" for k in ("cpu_pace", "cpu_cut_pace", "device_pace"))
        lines.append(f"| {row['file']} | {row['config']} | {row['budget']} | {row['miss_rate_budget']:.2f} / "
                     f"{row['miss_rate_run']:.2f} | {paces} | "
                     + " | ".join(f"{row['saving_ms'][p]:.2f}" for p in PRICINGS)
                     + f" | {row.get('over_mira_gpu', '-')} | {row.get('net_saved_ms_per_layer', '-')} |")
    table = "\n".join(lines)
    print(table)
    write_json_atomic(RESULTS / "hybrid-rule.json", {
        **result_header(" ".join(["python", "benchmarks/hybrid_rule.py", *sys.argv[1:]])),
        "inline_layer_ms": INLINE_LAYER_S * 1e3, "pricings": PRICINGS, "rows": rows})
    (RESULTS / "hybrid-rule.md").write_text(
        "# Auto's CPU-share rule, re-priced over the committed runs\n\n"
        f"Expected saving per decode layer in ms (auto takes the share at {INLINE_LAYER_S * 1e3:g} ms and more, "
        "priced as `rule`); `x mira-gpu` and `net ms/layer`: what the same run measured against GPU-only "
        "mira. `python benchmarks/hybrid_rule.py` (its docstring defines each pricing).\n\n" + table + "\n")
    print("wrote benchmarks/results/hybrid-rule.json and hybrid-rule.md")


if __name__ == "__main__":
    main()
