"""Share of prefetch copy time that overlaps expert compute on the GPU (issue #6).

Generates with the bundled model under a budget of a quarter of its experts, gate prefetching on,
inline residency (the staging this times goes through the policy's STAGE slots).
CUDA events bracket every prefetch copy (on the prefetch stream) and every expert FFN call (on the
compute stream); after the run, the share of copy time during which an FFN ran is the overlap.
(Attention and the rest of the model also run while copies fly; only expert compute is counted,
so the share is a lower bound.)

    python benchmarks/prefetch_overlap.py [OUT.json]     (CUDA only)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import mira
from mira.runtime.experts import MiraExperts
from mira.runtime.generate import encode_prompt
from mira.cache.transfer import Transfer
from mira.bench.provenance import result_header
from mira.store.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent


def _overlap(interval: tuple[float, float], others: list[tuple[float, float]]) -> float:
    start, end = interval
    covered, cursor = 0.0, start
    for o_start, o_end in others:  # sorted by start
        if o_end <= cursor or o_start >= end:
            continue
        covered += min(o_end, end) - max(o_start, cursor)
        cursor = min(o_end, end)
    return covered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="the JSON result to write",
                        default=ROOT / "benchmarks" / "results" / "prefetch-overlap-h200.json")
    args = parser.parse_args()
    probe = mira.load(device="cuda", vram_budget=64 << 30, progress=False)
    quarter = probe.store.num_layers * probe.store.num_experts // 4
    budget = probe.plan.reserve_bytes + quarter * probe.store.blob_bytes
    del probe
    model = mira.load(device="cuda", vram_budget=budget, prefetch="gate", residency="inline",
                      progress=False)  # prefetch copies through Transfer.load, which this times
    ids = encode_prompt(model, "How do I sort a list in Python?", raw=False)
    model.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up: kernels compiled

    copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    computes: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    load = Transfer.load

    def timed_load(self, src, dst, slot, prefetch=False):
        if not prefetch:
            return load(self, src, dst, slot, prefetch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.prefetch_stream.wait_stream(torch.cuda.current_stream(self.device))
        start.record(self.prefetch_stream)
        out = load(self, src, dst, slot, prefetch)
        end.record(self.prefetch_stream)
        copies.append((start, end))
        return out

    def timed(ffn):
        def call(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = ffn(*args, **kwargs)
            end.record()
            computes.append((start, end))
            return out
        return call

    for module in model.hf_model.modules():
        if isinstance(module, MiraExperts):
            module.ffn = timed(module.ffn)
    Transfer.load = timed_load
    base = torch.cuda.Event(enable_timing=True)
    base.record()
    model.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)
    torch.cuda.synchronize()
    Transfer.load = load

    def span(pair):
        return base.elapsed_time(pair[0]), base.elapsed_time(pair[1])  # ms since base

    copy_spans = [span(c) for c in copies]
    compute_spans = sorted(span(c) for c in computes)
    copy_ms = sum(end - start for start, end in copy_spans)
    overlapped = sum(_overlap(c, compute_spans) for c in copy_spans)
    stats = model.stats()
    figures = {"prefetch_copies_timed": len(copy_spans), "prefetch_copy_ms": copy_ms, "overlapped_ms": overlapped,
               "overlapped_share": overlapped / copy_ms if copy_ms else None,
               "expert_ffn_calls": len(compute_spans), "prefetch_counts": stats["prefetch"],
               "demand_copies": stats["cache"]["copies"]}
    print(json.dumps(figures, indent=1))
    out = {**result_header("python benchmarks/prefetch_overlap.py", "cuda"),
           "setup": {"model": "mira-tiny-moe", "slots": quarter, "new_tokens": 64, "prefetch": "gate",
                     "note": "events bracket each prefetch copy and each expert FFN call; overlap with "
                             "attention is not counted"},
           "figures": figures}
    write_json_atomic(args.out, json.loads(json.dumps(out, default=str)))


if __name__ == "__main__":
    main()
