"""Expert-cache policies on the bundled model's real routing (issue #4; paper IV-C, IV-D).

1. Records routing traces of mira-tiny-moe (greedy, CPU): held-out ShareGPT prompts (the first
   user message of the first held-out conversations, in file order) and, as the static policy's
   profile, prompts from the training split (so static's placement is not an oracle).
2. Replays the held-out trace through every policy and Belady's optimum at 25% and 50% of all
   experts as slots (shared by all layers), and a sweep of slot counts (PNG).
3. Tunes the mira policy's configuration (rebalance interval, swap bound, heat decay, STAGE
   fraction) on the TRAINING-split trace (at both sizes, misses over Belady's), so the held-out
   figures of step 2, made with CacheConfig's defaults, are not tuned on themselves.

Writes benchmarks/results/policies-tiny.json, policies-tiny.png and the traces under
benchmarks/results/traces/. Routing is the trained router's (real), on a 12-layer x 8-expert model.

    python benchmarks/policies.py [--prompts 48 --profile-prompts 24 --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

import mira
from mira.cache.simulate import format_table, plot_sweep, simulate
from mira.config import CacheConfig
from mira.predict.trace import RoutingTrace
from mira.runtime.tracing import record_trace
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ("mira", "lru", "lfu", "static", "on-demand", "belady")
sys.path.insert(0, str(ROOT / "tools"))
from sharegpt_data import first_user_messages  # noqa: E402  (tools/: the benchmarks' ShareGPT prompts)


def _trace(model, prompts: list[str], max_new_tokens: int, path: Path) -> RoutingTrace:
    if path.is_file():
        return RoutingTrace.load(path)
    trace = record_trace(model, prompts, max_new_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace.save(path)
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts traced")
    parser.add_argument("--profile-prompts", type=int, default=24, help="training prompts traced for static")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)

    model = mira.load(device="cpu", progress=False)
    held_out = _trace(model, first_user_messages(True, args.prompts), args.max_new_tokens,
                      RESULTS / "traces" / "heldout.npz")
    profile = _trace(model, first_user_messages(False, args.profile_prompts), args.max_new_tokens,
                     RESULTS / "traces" / "profile-train.npz")
    decode_tokens = int((~held_out.is_prefill).sum())
    total = held_out.num_uids
    expert_bytes = model.store.blob_bytes
    print(f"held-out trace (replayed with CacheConfig's defaults): {held_out.num_tokens} tokens ({decode_tokens} generated) from {args.prompts} prompts; "
          f"profile: {profile.num_tokens} tokens; {total} experts")

    sizes = {"25%": total // 4, "50%": total // 2}
    main_results = [simulate(held_out, policy, slots, expert_bytes=expert_bytes, profile=profile)
                    for slots in sizes.values() for policy in POLICIES]
    print(format_table(main_results))

    sweep_slots = [12, 24, 36, 48, 60, 72, 84]
    sweep = [simulate(held_out, policy, slots, expert_bytes=expert_bytes, profile=profile)
             for slots in sweep_slots for policy in POLICIES]
    plot_sweep(sweep, str(RESULTS / "policies-tiny.png"),
               title=f"mira-tiny-moe, held-out ShareGPT routing ({held_out.num_tokens} tokens)")

    belady = {slots: simulate(profile, "belady", slots)["misses"] for slots in sizes.values()}
    grid = itertools.product([1, 2, 4, 8, 16, 32], [1, 4, 16], [0.5, 0.8, 0.9, 0.97, 0.99], [0.25, 0.5])
    configs = []
    for interval, swaps, decay, stage in grid:
        config = CacheConfig(rebalance_interval=interval, max_swaps=swaps, heat_decay=decay,
                             stage_fraction_large=stage)
        ratios = {name: simulate(profile, "mira", slots, config=config)["misses"] / belady[slots]
                  for name, slots in sizes.items()}
        configs.append({"rebalance_interval": interval, "max_swaps": swaps, "heat_decay": decay,
                        "stage_fraction_large": stage, "misses_over_belady": ratios,
                        "mean": sum(ratios.values()) / len(ratios)})
    configs.sort(key=lambda c: c["mean"])
    print("\nmira configurations on the training-split trace, misses / Belady's (best 10 of", len(configs), "):")
    for c in configs[:10]:
        print(f"  interval {c['rebalance_interval']:3d}  swaps {c['max_swaps']:3d}  decay {c['heat_decay']:.2f}  "
              f"stage {c['stage_fraction_large']:.2f}  25%: {c['misses_over_belady']['25%']:.3f}  "
              f"50%: {c['misses_over_belady']['50%']:.3f}")
    defaults = dataclasses.asdict(CacheConfig())
    print("defaults:", {k: defaults[k] for k in ("rebalance_interval", "max_swaps", "heat_decay",
                                                 "stage_fraction_large")})

    result = {
        **result_header(" ".join(["python", "benchmarks/policies.py", *sys.argv[1:]])),
        "setup": {"model": "mira-tiny-moe (bundled; real learned routing)", "routing": "real",
                  "held_out_tokens": held_out.num_tokens, "held_out_decode_tokens": decode_tokens,
                  "profile_tokens": profile.num_tokens, "experts": total, "expert_bytes": expert_bytes,
                  "slots": sizes, "cache_config": defaults, **vars(args)},
        "results": main_results,
        "sweep": sweep,
        "mira_configurations_on_training_trace": configs,
    }
    out = RESULTS / "policies-tiny.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
