"""PCIe traffic of lagged against inline residency on the bundled model's real routing (CPU).

Lagged residency (mira.cache.tables) removes the host sync of every MoE layer call, but an expert
the policy admits after a miss crosses PCIe twice: the kernel reads it from pinned host memory
during the step, and the admission copies it into its slot after the step. Inline, a miss
crosses once (copied into its slot, or into a transient row). On the H200 with random routing
this made lagged LRU 0.61x and lagged mira 0.89x as fast as inline at 24 GiB
(benchmarks/results/bench-mixtral-8x7b*.json). This script counts, for real learned routing,
the expert blobs that would cross PCIe per generated token in each mode:

- inline: one per miss lookup (its copy into a slot or a transient row);
- lagged: one per miss lookup (the kernel's read; a prefill's misses are copied, as inline) plus
  one per copy `ExpertCache.settle` makes (admissions of experts the kernels already read).

Counts cover whole generate calls (prompt steps too) and are divided by the generated tokens.

It generates greedily from held-out ShareGPT prompts at 10%, 25% and 50% of the 96 experts as
slots, for the mira policy, LRU and static placement (placed by the committed training-split
trace), in both modes, checks that both modes generate the same tokens, and writes
benchmarks/results/lagged-traffic-tiny.json. Counting needs no GPU: the CPU runs the same
mechanism, and only the bytes' path differs.

    python benchmarks/lagged_traffic.py [--prompts 16 --max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import mira
from mira.runtime.generate import encode_prompt
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROFILE = RESULTS / "traces" / "profile-train.npz"  # training-split routing (benchmarks/policies.py)
SHARES = (0.10, 0.25, 0.50)
POLICIES = ("mira", "lru", "static")
sys.path.insert(0, str(ROOT / "tools"))
from sharegpt_data import first_user_messages  # noqa: E402  (tools/: the benchmarks' ShareGPT prompts)


def _count_settle_copies(model) -> list[int]:
    """A one-element list counting the copies `ExpertCache.settle` makes: lagged admissions of
    experts the kernels have already read (inline, and in a lagged prefill, a miss's copy is its
    only crossing; settle makes none)."""
    count, settle = [0], model.cache.settle

    def counted() -> None:
        before = model.cache.telemetry.copies
        settle()
        count[0] += model.cache.telemetry.copies - before

    model.cache.settle = counted
    return count


def _run(prompts: list[str], max_new_tokens: int, slots: int, policy: str, residency: str) -> dict:
    probe = mira.load(device="cpu", vram_budget=1 << 30, progress=False)
    model = mira.load(device="cpu", vram_budget=probe.plan.reserve_bytes + slots * probe.store.blob_bytes,
                      policy=policy, prefetch="off", residency=residency, progress=False,
                      profile=PROFILE if policy == "static" else None)
    settled = _count_settle_copies(model)
    outputs, generated = [], 0
    for prompt in prompts:
        ids = encode_prompt(model, prompt, raw=False)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.tokenizer.eos_token_id)
        outputs.append(out[0].tolist())
        generated += out.shape[1] - ids.shape[1]
    cache = model.stats()["cache"]
    misses, admissions = cache["lookups"]["miss"], settled[0]
    crossings = misses + admissions
    return {"slots": slots, "policy": policy, "residency": residency, "generated_tokens": generated,
            "miss_lookups": misses, "copies": cache["copies"], "admissions_after_a_read": admissions,
            "crossings": crossings,
            "crossings_per_token": round(crossings / generated, 3), "hit_rate": round(cache["hit_rate"], 4),
            "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts generated from")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = first_user_messages(True, args.prompts)
    store = mira.load(device="cpu", progress=False).store
    total = store.num_layers * store.num_experts
    rows = []
    print(f"{'slots':>5} {'policy':>7} {'inline':>8} {'lagged':>8} {'lagged/inline':>13}   expert blobs over PCIe "
          "per generated token")
    for share in SHARES:
        for policy in POLICIES:
            pair = [_run(prompts, args.max_new_tokens, round(share * total), policy, mode)
                    for mode in ("inline", "lagged")]
            if pair[0]["outputs"] != pair[1]["outputs"]:
                raise SystemExit(f"lagged and inline generated different tokens ({policy}, {share:.0%})")
            inline, lagged = (r["crossings_per_token"] for r in pair)
            print(f"{pair[0]['slots']:5d} {policy:>7} {inline:8.3f} {lagged:8.3f} {lagged / inline:13.3f}")
            rows += [{k: v for k, v in r.items() if k != "outputs"} for r in pair]

    result = {
        **result_header(" ".join(["python", "benchmarks/lagged_traffic.py", *sys.argv[1:]])),
        "setup": {"model": "mira-tiny-moe (bundled; real learned routing)", "routing": "real",
                  "total_experts": total, "static_profile": str(PROFILE.relative_to(ROOT)), **vars(args)},
        "crossings": "expert blobs over PCIe per generate call, prompt steps included: inline, one per miss lookup; "
                     "lagged, one per miss lookup plus one per copy made by ExpertCache.settle (an admission of an "
                     "expert the kernels already read). Lookups are per layer call.",
        "runs": rows,
    }
    out = RESULTS / "lagged-traffic-tiny.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
