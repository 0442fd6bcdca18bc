"""Where a decode step's host time goes inside Mira's experts modules (CPU, bundled model).

Run eagerly (inline residency), a decode step is bound by the host's Python rather than the
device. This script times, per MoE layer call, the pieces of `MiraExperts.forward` that run on
the host (with a share of the experts in slots, and with all of them): the routing read-back
and the policy's work (`ExpertCache.settle_layer`), staging's work before and after the layer,
the predictor's scores, the FFN call, and the rest of the forward (counting and glue), each
wrapped with `time.perf_counter` (the wrappers add about a microsecond per call). On the CPU the
FFN is the PyTorch reference and computes for real, so its figure is not the GPU's; the
bookkeeping figures are plain Python and carry over, scaled by the host's speed.
`benchmarks/profile_decode.py` gives the same pieces on a GPU, with the device's side.

    python benchmarks/host_overhead.py [--new-tokens 64 --prompts 4]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import mira
from mira.runtime.experts import MiraExperts
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "How do I sort a list of dictionaries by a key in Python?"
HEADS = ROOT / "benchmarks" / "results" / "predictor-tiny-heads.safetensors"  # benchmarks/predictor.py


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, attr, timed)


def profile(setting: str, slots_share: float, new_tokens: int, prompts: int) -> dict:
    probe = mira.load(device="cpu", vram_budget=1 << 40, progress=False)
    total = probe.store.num_layers * probe.store.num_experts
    budget = probe.plan.reserve_bytes + int(slots_share * total) * probe.store.blob_bytes
    # inline: the per-layer-call host work this script times (lagged residency moves it to one settle per step)
    model = mira.load(device="cpu", vram_budget=budget, prefetch=setting, residency="inline", progress=False,
                      heads=HEADS if setting == "trained" else None)
    timers = Timers()
    experts = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    timers.wrap(model.cache, "settle_layer", "cache.settle_layer")  # inline: the read-back and the policy
    if model.cache.staging is not None:
        for name in ("before_layer", "after_layer"):
            timers.wrap(model.cache.staging, name, f"staging.{name}")
    timers.wrap(experts[0], "ffn", "ffn")  # one kernel object shared by every layer
    ffn = experts[0].ffn
    for module in experts:
        module.ffn = ffn
        timers.wrap(module, "forward", "MiraExperts.forward")
    if experts[0].predictor is not None:
        timers.wrap(experts[0].predictor, "scores", "predictor.scores")
        timers.wrap(experts[0].predictor, "observe", "predictor.observe")
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    for key in list(timers.seconds):
        timers.seconds[key], timers.calls[key] = 0.0, 0
    start = time.perf_counter()
    for _ in range(prompts):
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - start
    layer_calls = timers.calls["MiraExperts.forward"]
    per_call = {name: round(seconds / layer_calls * 1e6, 1) for name, seconds in timers.seconds.items()}
    forward = per_call["MiraExperts.forward"]
    inner = sum(v for k, v in per_call.items() if k in ("cache.settle_layer", "staging.before_layer",
                                                        "staging.after_layer", "ffn"))
    steps = prompts * new_tokens
    return {"prefetch": setting, "slots": model.cache.pool.num_slots, "total_experts": total,
            "layer_calls": layer_calls, "us_per_layer_call": per_call,
            "us_per_layer_call_rest_of_forward": round(forward - inner - per_call.get("predictor.scores", 0)
                                                       - per_call.get("predictor.observe", 0), 1),
            "ms_per_step": round(wall / steps * 1e3, 3),
            "experts_share_of_step": round(timers.seconds["MiraExperts.forward"] / wall, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--slots-share", type=float, default=0.25, help="share of the experts with a slot")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [profile(setting, args.slots_share, args.new_tokens, args.prompts) for setting in ("off", "gate", "trained")]
    rows.append(profile("off", 1.0, args.new_tokens, args.prompts))  # every expert resident: no lookups, no sync
    names = ["MiraExperts.forward", "ffn", "cache.settle_layer", "staging.before_layer", "staging.after_layer",
             "predictor.scores", "predictor.observe"]
    print(f"{'prefetch':>8} {'slots':>6} " + " ".join(f"{n:>20}" for n in names) + f" {'rest':>8} {'ms/step':>8}")
    for row in rows:
        cells = [row["us_per_layer_call"].get(n) for n in names]
        print(f"{row['prefetch']:>8} {row['slots']:>6} " + " ".join(f"{'' if c is None else c:>20}" for c in cells)
              + f" {row['us_per_layer_call_rest_of_forward']:>8} {row['ms_per_step']:>8}")
    print("(microseconds per MoE layer call; cache.settle_layer holds the routing read-back; rest = counting and glue)")
    out = ROOT / "benchmarks" / "results" / "host-overhead-cpu.json"
    out.write_text(json.dumps({
        **result_header("python benchmarks/host_overhead.py"),
        "setup": {"model": "mira-tiny-moe (bundled)", **vars(args)}, "runs": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
