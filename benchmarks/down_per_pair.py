"""Time decode layers whose down launch walks a token's experts in turn against apart.

One down program used to walk a token's K routed experts in turn, waiting on memory for each;
with `KernelConfig.down_per_pair` each expert gets programs of its own, whose partial sums the last
to arrive adds. Per expert shape and scheme (random INT4 and int8-shared blobs, bf16 activations,
one token), on one GPU, in turns within each repeat, the stored (or untuned) configuration both
ways: one expert from HBM, a token's layer at the model's own top-k (its K experts of 8 distinct
blobs) from HBM, and the same layer with every expert read zero-copy from pinned host memory (a
layer of misses under a budget). Each way's error against the float32 reference is recorded. Figures
are per call, --repeats repeats of the median of --replays CUDA-graph replays (median and range),
against the experts walked in turn in the same run.

    python benchmarks/down_per_pair.py [--shapes qwen3-30b-a3b,...] [--schemes int4,int8-shared] [--out FILE]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dependent_launch import TopKLayer, cell, cuda_run, layer_parser  # noqa: E402
from kernels_int4 import MODEL_TOP_K, relative_error, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.kernels.triton_ffn import TritonMoEFFN  # noqa: E402
from mira.kernels.triton_int4 import TritonInt4MoEFFN, load_int4_config  # noqa: E402
from mira.kernels.tuning import load_config  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402

WAYS = {"in turn": False, "apart": True}  # KernelConfig.down_per_pair
TIMES = ("one_expert_s", "layer_s", "zero_copy_layer_s")


def kernels(scheme: str, gpu: str, hidden: int, intermediate: int):
    """The kernel class of a scheme and its stored (or untuned) configuration on this GPU."""
    if scheme == "int4":
        return TritonInt4MoEFFN, load_int4_config(gpu, hidden, intermediate)
    return TritonMoEFFN, load_config(gpu, hidden, intermediate)


def main() -> None:
    parser = layer_parser(__doc__, ",".join(MODEL_TOP_K), "down-per-pair.json")
    parser.add_argument("--schemes", default="int4,int8-shared")
    args = parser.parse_args()
    device, gpu, timer, result = cuda_run(args)
    rows = []
    for name in args.shapes.split(","):
        result["shapes"][name] = {}
        for scheme in args.schemes.split(","):
            layer = TopKLayer(name, device, timer, scheme)
            layout, top_k = layer.layout, layer.top_k
            kind, stored = kernels(scheme, gpu, layout.hidden, layout.intermediate)
            truth = layer.reference()
            ffns = {way: kind(layout, device, config=dataclasses.replace(stored, down_per_pair=apart))
                    for way, apart in WAYS.items()}
            figures = {"hidden": layout.hidden, "intermediate": layout.intermediate, "top_k": top_k,
                       "config": stored.to_json(), "ways": {}}
            for way, ffn in ffns.items():
                figures["ways"][way] = {"relative_error_vs_fp32_reference": relative_error(layer.call(ffn), truth),
                                        **{key: [] for key in TIMES}}
            for _ in range(args.repeats):
                for way, ffn in ffns.items():
                    entry = figures["ways"][way]
                    entry["one_expert_s"].append(layer.work.one_expert(ffn))
                    entry["layer_s"].append(layer.time(ffn))
                    entry["zero_copy_layer_s"].append(layer.zero_copy_time(ffn))
            base = {key: statistics.median(figures["ways"]["in turn"][key]) for key in TIMES}
            for way, entry in figures["ways"].items():
                for key in TIMES:
                    entry[key.replace("_s", "_over_in_turn")] = statistics.median(entry[key]) / base[key]
                    entry[key] = spread(entry[key])
                rows.append(f"{name:16} {scheme:11} {top_k:5} {way:8} "
                            + "  ".join(cell(entry, key, "in_turn") for key in TIMES)
                            + f"  err {entry['relative_error_vs_fp32_reference']:.1e}")
            result["shapes"][name][scheme] = figures
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.out, result)  # after each: what a cut-short run measured stays
            del layer, ffns
            torch.cuda.empty_cache()
    print("shape            scheme      top-k way       one expert us [range] x in turn   top-k layer us   "
          "top-k layer zero-copy us")
    print("\n".join(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
