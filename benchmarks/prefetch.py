"""Predictive staging on the bundled model's real routing (issue #6; paper IV-E, Table III).

1. Generates (greedy, CPU) from held-out ShareGPT prompts with every expert in a slot and gate
   speculation on, recording the routing trace and, per step and MoE layer, the experts the
   predictor offered to STAGE (for layer i+2, at layer i).
2. Replays that trace in the simulator at about 10%, 25% and 50% of all experts as slots: the mira
   policy with prefetch off, with the recorded gate predictions, and with perfect predictions (the
   actual routing at i+2; staged experts reclaimed right after use, or kept in STAGE), next to
   LRU, LFU and Belady's optimum (no prefetch).
3. Runs the runtime itself at the same budgets with prefetch off and gate: misses per token.

    python benchmarks/prefetch.py [--prompts 16 --max-new-tokens 64]

Writes benchmarks/results/prefetch-tiny.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import mira
from mira.cache.simulate import simulate
from mira.predict.prefetcher import PrefetchBook
from mira.runtime.generate import encode_prompt
from mira.runtime.tracing import RoutingRecorder

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from policies import _prompts  # noqa: E402  (held-out ShareGPT prompts, as in policies.py)


def _record(prompts: list[str], max_new_tokens: int):
    """Trace and gate predictions [T, L, P] (-1 padded) of greedy generation, all experts resident."""
    probe = mira.load(device="cpu", vram_budget=1 << 30, progress=False)
    model = mira.load(device="cpu", vram_budget=probe.plan.reserve_bytes + 96 * probe.store.blob_bytes,
                      prefetch="gate", progress=False)
    offered: list[tuple[int, list[int]]] = []  # (target layer, experts) in call order
    stage = model.cache.stage
    model.cache.stage = lambda layer, experts: (offered.append((layer, list(experts))), stage(layer, experts))
    with RoutingRecorder(model) as recorder:
        for prompt in prompts:
            recorder.next_sequence()
            model.generate(encode_prompt(model, prompt, raw=False), max_new_tokens=max_new_tokens,
                           do_sample=False, pad_token_id=model.tokenizer.eos_token_id)
    trace = recorder.trace()
    L, E = trace.num_layers, trace.num_experts
    steps = [ids.shape[0] for ids in recorder._ids]  # tokens per forward step
    predictions = np.full((trace.num_tokens, L, E), -1, dtype=np.int64)
    calls = iter(offered)
    start = 0
    for tokens in steps:
        for _ in range(L - 2):
            layer, experts = next(calls)
            predictions[start:start + tokens, layer, :len(experts)] = experts
        start += tokens
    return trace, predictions, model.store.blob_bytes


def _runtime(prompts, max_new_tokens, slots, prefetch):
    probe = mira.load(device="cpu", vram_budget=1 << 30, progress=False)
    model = mira.load(device="cpu", vram_budget=probe.plan.reserve_bytes + slots * probe.store.blob_bytes,
                      prefetch=prefetch, progress=False)
    tokens = 0
    for prompt in prompts:
        ids = encode_prompt(model, prompt, raw=False)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.tokenizer.eos_token_id)
        tokens += out.shape[1]
    stats = model.stats()
    return {"slots": slots, "prefetch": prefetch, "tokens": tokens,
            "misses": stats["cache"]["lookups"]["miss"], "misses_per_token": stats["cache"]["lookups"]["miss"] / tokens,
            "prefetch_counts": stats["prefetch"], "prefetch_copies": stats["cache"]["prefetch_copies"],
            "demand_copies": stats["cache"]["copies"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = _prompts(True, args.prompts)
    trace, gate, blob = _record(prompts, args.max_new_tokens)
    oracle = trace.topk_ids.astype(np.int64)
    total = trace.num_uids
    print(f"trace: {trace.num_tokens} tokens ({int((~trace.is_prefill).sum())} generated), {total} experts")

    rows = []
    for slots in (round(total * 0.1), total // 4, total // 2):
        def run(policy, predictions=None, name=None, **options):
            r = simulate(trace, policy, slots, expert_bytes=blob, predictions=predictions, **options)
            r["setting"] = name or policy
            rows.append(r)
            return r

        for policy in ("lru", "lfu", "belady"):
            run(policy)
        off = run("mira", name="mira, prefetch off")
        on = run("mira", gate, name="mira, prefetch gate")
        run("mira", oracle, name="mira, perfect predictions")
        run("mira", oracle, name="mira, perfect predictions, used kept in STAGE", reclaim_used=False)
        lfu = next(r for r in rows if r["slots"] == slots and r["setting"] == "lfu")
        belady = next(r for r in rows if r["slots"] == slots and r["setting"] == "belady")
        avoidable = lfu["misses"] - belady["misses"]
        on["removed_over_lfu_minus_belady"] = (off["misses"] - on["misses"]) / avoidable if avoidable else None

    print(f"{'slots':>5}  {'setting':48s} {'misses/token':>12} {'prefetch used':>13} {'wasted':>7}")
    for r in rows:
        print(f"{r['slots']:5d}  {r['setting']:48s} {r['misses'] / r['tokens']:12.3f} "
              f"{r.get('prefetch_used', 0):13d} {r.get('prefetch_wasted', 0):7d}")
    for r in rows:
        if "removed_over_lfu_minus_belady" in r:
            print(f"{r['slots']} slots: gate prefetch removes {r['removed_over_lfu_minus_belady']:.2f} of "
                  f"(LFU - Belady) misses")

    runtime = [_runtime(prompts, args.max_new_tokens, slots, prefetch)
               for slots in (round(total * 0.1), total // 4, total // 2) for prefetch in ("off", "gate")]
    print("\nruntime (CPU):")
    for r in runtime:
        print(f"  {r['slots']:3d} slots, prefetch {r['prefetch']:4s}: {r['misses_per_token']:.3f} misses/token, "
              f"{r['prefetch_copies']} prefetch copies, {r['demand_copies']} demand copies")

    result = {
        "command": " ".join(["python", "benchmarks/prefetch.py", *sys.argv[1:]]),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "machine": f"{platform.node()}, {platform.machine()}, CPU, torch {torch.__version__}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "setup": {"model": "mira-tiny-moe (bundled; real learned routing)", "prompts": "held-out ShareGPT",
                  "tokens": trace.num_tokens, "experts": total, **vars(args),
                  "default_book": PrefetchBook().reclaim_used and "staged experts reclaimed right after use"},
        "simulated": rows,
        "runtime": runtime,
    }
    out = ROOT / "benchmarks" / "results" / "prefetch-tiny.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
