"""Predictive staging on the bundled model's real routing (paper IV-C, IV-E, Table III).

1. Simulator: replays the held-out trace that benchmarks/predictor.py records with predictor
   features (100 held-out ShareGPT prompts, 64 new tokens each; recorded here when missing) at
   10%, 25% and 50% of the 96 experts as slots: LFU and Belady's optimum (no prefetch), the mira
   policy with prefetch off, and with the predictions `mira simulate --predictions` replays: gate
   speculation, the trained MixtureHeads (benchmarks/results/predictor-tiny-heads.safetensors),
   the previous step, popularity (ranked by the committed training-split trace) and perfect
   predictions (whose best may already be resident: not the best staging); one expert staged per
   target layer and step, as at run time. Misses, prefetch copies and all PCIe copies (misses +
   prefetches) per token, and the issue's goal, (LFU - misses) / (LFU - Belady) >= 0.5. The
   simulator counts one access per token, layer and expert, prompt tokens one by one (DESIGN.md 5).
2. Runtime (CPU, greedy, every expert from the store through the slot pool): the first 16 of the
   same prompts at the same budgets with prefetch off, gate and trained. Its counts are per layer
   call: a prompt's tokens share one lookup per expert.

    python benchmarks/prefetch.py [--runtime-prompts 16 --max-new-tokens 64]

Writes benchmarks/results/prefetch-tiny.json and prints both tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

import mira
from mira.bench.simulate import load_predictions, simulate
from mira.cache.config import CacheConfig
from mira.predict.baselines import GateSpeculation
from mira.runtime.experts import model_routers
from mira.cli.predictor import record_with_features
from mira.predict.heads import TrainedPredictor, load_heads
from mira.store.trace import RoutingTrace
from mira.runtime.experts import MiraExperts
from mira.runtime.generate import encode_prompt
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
HEADS = RESULTS / "predictor-tiny-heads.safetensors"
PROFILE = RESULTS / "traces" / "profile-train.npz"  # training-split routing (benchmarks/policies.py)
SHARES = (0.10, 0.25, 0.50)
sys.path.insert(0, str(ROOT / "tools"))
from sharegpt_data import first_user_messages  # noqa: E402  (tools/: the benchmarks' ShareGPT prompts)


def _heldout_trace(prompts: int, max_new_tokens: int) -> Path:
    """The held-out trace with features of benchmarks/predictor.py, recorded if it is not there."""
    path = ROOT / ".carry" / "predictor" / f"heldout-0-{prompts}x{max_new_tokens}.npz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        record_with_features(mira.load(device="cpu", progress=False), first_user_messages(True, prompts),
                             max_new_tokens, path)
    return path


def _simulated(trace: RoutingTrace, blob_bytes: int) -> list[dict]:
    profile = RoutingTrace.load(PROFILE)
    predictions = {name: load_predictions(name, trace, heads=HEADS, profile=profile)
                   for name in ("gate", "trained", "previous", "popularity", "oracle")}
    rows = []
    for slots in (round(share * trace.num_uids) for share in SHARES):
        lfu = simulate(trace, "lfu", slots, expert_bytes=blob_bytes)
        belady = simulate(trace, "belady", slots, expert_bytes=blob_bytes)
        runs = [("lfu", None, lfu), ("belady", None, belady),
                ("mira, prefetch off", None, simulate(trace, "mira", slots, expert_bytes=blob_bytes))]
        for name in predictions:
            result = simulate(trace, "mira", slots, expert_bytes=blob_bytes, predictions=predictions[name])
            runs.append((f"mira, prefetch {name}", name, result))
        for setting, predictor, result in runs:
            rows.append({
                "slots": slots, "setting": setting, "predictor": predictor,
                **{key: result[key] for key in ("tokens", "accesses", "misses", "copies", "hits_hot", "hits_stage")},
                **{key: value for key, value in result.items() if key.startswith("prefetch_")},
                "misses_per_token": result["misses"] / trace.num_tokens,
                "prefetches_per_token": result.get("prefetch_issued", 0) / trace.num_tokens,
                "copies_per_token": result["copies"] / trace.num_tokens,
                "goal_lfu_minus_misses_over_lfu_minus_belady":
                    (lfu["misses"] - result["misses"]) / (lfu["misses"] - belady["misses"]),
            })
    return rows


def _runtime(prompts: list[str], max_new_tokens: int, slots: int, prefetch: str) -> dict:
    probe = mira.load(device="cpu", vram_budget=1 << 30, progress=False)
    # inline in every setting, as prefetching is: the same per-call accounting (a miss is one copy)
    model = mira.load(device="cpu", vram_budget=probe.plan.reserve_bytes + slots * probe.store.blob_bytes,
                      prefetch="off" if prefetch == "off" else "gate", residency="inline", progress=False)
    if prefetch == "trained":  # the benchmark's heads, not the store's (the store may have none)
        heads, _ = load_heads(HEADS, model.store.manifest.source_fingerprint)
        predictor = TrainedPredictor(heads, GateSpeculation(model_routers(model.hf_model), model.store.num_experts), "cpu")
        for module in model.hf_model.modules():
            if isinstance(module, MiraExperts):
                module.predictor = predictor
    tokens = 0
    for prompt in prompts:
        out = model.generate(encode_prompt(model, prompt, raw=False), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.tokenizer.eos_token_id)
        tokens += out.shape[1]
    stats = model.stats()
    misses, prefetches = stats["cache"]["lookups"]["miss"], stats["cache"]["prefetch_copies"]
    return {"slots": slots, "prefetch": prefetch, "tokens": tokens, "misses": misses, "prefetch_copies": prefetches,
            "copies": misses + prefetches, "demand_copies_into_slots": stats["cache"]["copies"],
            "misses_per_token": misses / tokens, "prefetches_per_token": prefetches / tokens,
            "copies_per_token": (misses + prefetches) / tokens, "prefetch_counts": stats["prefetch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout-prompts", type=int, default=100, help="prompts of the simulated trace")
    parser.add_argument("--runtime-prompts", type=int, default=16, help="prompts the runtime generates from")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    blob_bytes = mira.load(device="cpu", progress=False).store.blob_bytes
    trace_path = _heldout_trace(args.heldout_prompts, args.max_new_tokens)
    trace = RoutingTrace.load(trace_path)
    print(f"trace {trace_path.relative_to(ROOT)}: {trace.num_tokens} tokens "
          f"({int((~trace.is_prefill).sum())} generated), {trace.num_uids} experts")

    simulated = _simulated(trace, blob_bytes)
    print(f"\nsimulated, per token of the trace:\n{'slots':>5}  {'setting':28s} {'misses':>7} "
          f"{'prefetches':>10} {'copies':>7} {'goal':>6}")
    for r in simulated:
        print(f"{r['slots']:5d}  {r['setting']:28s} {r['misses_per_token']:7.3f} "
              f"{r['prefetches_per_token']:10.3f} {r['copies_per_token']:7.3f} "
              f"{r['goal_lfu_minus_misses_over_lfu_minus_belady']:6.2f}")

    prompts = first_user_messages(True, args.runtime_prompts)
    runtime = [_runtime(prompts, args.max_new_tokens, round(share * trace.num_uids), prefetch)
               for share in SHARES for prefetch in ("off", "gate", "trained")]
    print(f"\nruntime (CPU), per token, lookups per layer call:\n{'slots':>5}  {'prefetch':8s} {'misses':>7} "
          f"{'prefetches':>10} {'copies':>7} {'used':>6} {'wasted':>6}")
    for r in runtime:
        print(f"{r['slots']:5d}  {r['prefetch']:8s} {r['misses_per_token']:7.3f} {r['prefetches_per_token']:10.3f} "
              f"{r['copies_per_token']:7.3f} {r['prefetch_counts']['used']:6d} {r['prefetch_counts']['wasted']:6d}")

    result = {
        **result_header(" ".join(["python", "benchmarks/prefetch.py", *sys.argv[1:]])),
        "setup": {"model": "mira-tiny-moe (bundled; real learned routing)", "routing": "real",
                  "trace": str(trace_path.relative_to(ROOT)), "trace_tokens": trace.num_tokens,
                  "experts": trace.num_uids, "heads": str(HEADS.relative_to(ROOT)),
                  "popularity_profile": str(PROFILE.relative_to(ROOT)), "expert_bytes": blob_bytes,
                  "cache_config": dataclasses.asdict(CacheConfig()), **vars(args)},
        "copies": "misses + prefetch copies: every expert blob moved over PCIe (a miss is one copy, admitted or not)",
        "simulated": simulated,
        "runtime": runtime,
    }
    out = RESULTS / "prefetch-tiny.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
