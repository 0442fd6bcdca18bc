"""Expert-cache policies on real routing: the mira policy against LRU, LFU, static and Belady (paper IV-C, IV-D).

1. Records routing traces of the bundled mira-tiny-moe (greedy, CPU) if they are not there yet:
   held-out ShareGPT prompts (the first user message of the first held-out conversations, in
   file order) and training-split prompts, the profile (the static placement and mira's prior).
2. Tunes the mira policy's heat decay, prior weight and admission margin on the TRAINING-split trace alone: its
   first half of sequences is the profile, its second half is replayed (lagged residency, at 10%,
   25% and 50% of the experts, PCIe bytes over the best baseline's).
3. Replays the held-out traces, none of them used for tuning, through every policy at 10%, 25%
   and 50% of the experts as slots (shared by all layers): the bundled model's held-out prompts
   (profile: the training trace) and the recorded Mixtral-8x7B-Instruct decode routing in
   results/traces (its first quarter of tokens is the calibration, the rest is replayed; and, for
   reference, the whole trace with itself as an oracle profile). mira's bytes are given lagged
   (an admission crosses PCIe a second time, as in graph-replayed decoding, the default on CUDA)
   and inline (the same decisions, the admission being the miss's copy); the baselines' inline,
   their cheaper residency (static never admits, so it moves the same either way).

Writes benchmarks/results/policies-real.json and a markdown table beside it (policies-real.md).

    python benchmarks/policies.py [--prompts 48 --profile-prompts 24 --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

from mira.bench.provenance import result_header
from mira.bench.simulate import MIXTRAL_EXPERT_BYTES, simulate
from mira.cache.config import CacheConfig
from mira.store.trace import RoutingTrace

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TRACES = RESULTS / "traces"
SHARES = (0.10, 0.25, 0.50)
BASELINES = ("lru", "lfu", "static")
MIXTRAL_TRACE = TRACES / "mixtral-8x7b-instruct-decode.npz"
TINY_EXPERT_BYTES = 393_728  # the bundled model's int8-shared blob (mira.store.layout)


def _record(prompts: int, profile_prompts: int, max_new_tokens: int) -> None:
    """Record the bundled model's traces (CPU, greedy), unless they exist."""
    sys.path.insert(0, str(ROOT / "tools"))
    from sharegpt_data import first_user_messages  # tools/: the benchmarks' ShareGPT prompts

    import mira
    from mira.runtime.tracing import record_trace

    model = mira.load(device="cpu", progress=False)
    for name, held_out, count in (("heldout", True, prompts), ("profile-train", False, profile_prompts)):
        path = TRACES / f"{name}.npz"
        if not path.is_file():
            record_trace(model, first_user_messages(held_out, count), max_new_tokens).save(path)


def _halves(trace: RoutingTrace) -> tuple[RoutingTrace, RoutingTrace]:
    """The trace split between sequences, at the first sequence start past half its tokens."""
    starts = np.flatnonzero(np.diff(trace.seq_id)) + 1
    cut = int(starts[np.searchsorted(starts, trace.num_tokens // 2)])
    return trace.tokens(0, cut), trace.tokens(cut, trace.num_tokens)


def _row(trace: RoutingTrace, profile: RoutingTrace, slots: int, expert_bytes: int, config: CacheConfig) -> dict:
    """Every policy at one slot count: PCIe bytes, misses, admissions; mira against the baselines and Belady."""
    runs = {f"mira-{residency}": simulate(trace, "mira", slots, expert_bytes=expert_bytes, profile=profile,
                                          config=config, residency=residency) for residency in ("lagged", "inline")}
    runs.update({name: simulate(trace, name, slots, expert_bytes=expert_bytes, profile=profile)
                 for name in BASELINES})
    runs["belady"] = simulate(trace, "belady", slots, expert_bytes=expert_bytes)
    copies = {name: run["copies"] for name, run in runs.items()}
    best_baseline = min(copies[name] for name in BASELINES)
    return {
        "slots": slots,
        "copies": copies,
        "misses": {name: run["misses"] for name, run in runs.items()},
        "admissions": {name: run.get("admissions") for name, run in runs.items()},
        "pcie_gb": {name: round(run["pcie_bytes"] / 1e9, 3) for name, run in runs.items()},
        "mira_lagged_over_best_baseline": round(copies["mira-lagged"] / best_baseline, 4),
        "mira_lagged_over_belady": round(copies["mira-lagged"] / copies["belady"], 3),
        "mira_inline_over_belady": round(copies["mira-inline"] / copies["belady"], 3),
    }


def _tune(training: RoutingTrace) -> list[dict]:
    profile, replayed = _halves(training)
    configs = []
    for decay, weight, margin in itertools.product((0.9, 0.95, 0.97, 0.99), (3, 10, 30, 100, 300), (0, 0.5, 1, 2)):
        config = CacheConfig(heat_decay=decay, prior_weight=weight, admission_margin=margin)
        ratios = []
        for share in SHARES:
            slots = round(share * training.num_uids)
            mira = simulate(replayed, "mira", slots, profile=profile, config=config, residency="lagged")["copies"]
            best = min(simulate(replayed, name, slots, profile=profile)["copies"] for name in BASELINES)
            ratios.append(mira / best)
        configs.append({"heat_decay": decay, "prior_weight": weight, "admission_margin": margin,
                        "over_best_baseline": ratios,
                        "worst": max(ratios)})
    return sorted(configs, key=lambda c: (c["worst"], sum(c["over_best_baseline"])))


def _table(cases: list[dict]) -> str:
    lines = ["| trace | slots | mira lagged | mira inline | LRU | LFU | static | Belady | mira lagged / best baseline "
             "| mira lagged / Belady |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for case in cases:
        for row in case["rows"]:
            gb = row["pcie_gb"]
            lines.append(f"| {case['name']} | {row['slots']} | " + " | ".join(
                f"{gb[name]:,.1f}" for name in ("mira-lagged", "mira-inline", "lru", "lfu", "static", "belady"))
                + f" | {row['mira_lagged_over_best_baseline']:.3f} | {row['mira_lagged_over_belady']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts traced")
    parser.add_argument("--profile-prompts", type=int, default=24, help="training prompts traced (the profile)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    _record(args.prompts, args.profile_prompts, args.max_new_tokens)
    training = RoutingTrace.load(TRACES / "profile-train.npz")
    held_out = RoutingTrace.load(TRACES / "heldout.npz")
    mixtral = RoutingTrace.load(MIXTRAL_TRACE)

    tuning = _tune(training)
    chosen = CacheConfig()
    print("tuning on the training trace (mira lagged / best baseline at 10, 25, 50%), best 5:")
    for c in tuning[:5]:
        print(f"  decay {c['heat_decay']:.2f}  prior weight {c['prior_weight']:>4}  margin {c['admission_margin']:>3}: "
              + ", ".join(f"{r:.3f}" for r in c["over_best_baseline"]))
    print(f"CacheConfig's defaults: decay {chosen.heat_decay}, prior weight {chosen.prior_weight}, "
          f"admission margin {chosen.admission_margin}")

    calibration = mixtral.num_tokens // 4
    cases = [
        ("mira-tiny-moe held-out (profile: training trace)", held_out, training, TINY_EXPERT_BYTES),
        ("Mixtral-8x7B-Instruct, last 3/4 (calibration: first 1/4)", mixtral.tokens(calibration, mixtral.num_tokens),
         mixtral.tokens(0, calibration), MIXTRAL_EXPERT_BYTES),
        ("Mixtral-8x7B-Instruct, whole (oracle profile: itself)", mixtral, mixtral, MIXTRAL_EXPERT_BYTES),
    ]
    results = []
    for name, trace, profile, expert_bytes in cases:
        rows = [_row(trace, profile, round(share * trace.num_uids), expert_bytes, chosen) for share in SHARES]
        results.append({"name": name, "tokens": trace.num_tokens, "profile_tokens": profile.num_tokens,
                        "experts": trace.num_uids, "expert_bytes": expert_bytes, "rows": rows})
    table = _table(results)
    print("\nPCIe GB moved (misses, plus admissions when lagged):\n" + table)

    result = {
        **result_header(" ".join(["python", "benchmarks/policies.py", *sys.argv[1:]])),
        "setup": {"shares_of_experts": SHARES, "cache_config": dataclasses.asdict(chosen),
                  "tuned_on": "traces/profile-train.npz (first half of sequences as profile, second half replayed)",
                  "held_out": ["traces/heldout.npz", "traces/mixtral-8x7b-instruct-decode.npz"], **vars(args)},
        "cases": results,
        "tuning": tuning,
    }
    (RESULTS / "policies-real.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "policies-real.md").write_text(
        "PCIe GB moved replaying real routing (`python benchmarks/policies.py`, from policies-real.json).\n\n"
        + table + "\n")
    print("wrote benchmarks/results/policies-real.json and policies-real.md")


if __name__ == "__main__":
    main()
