"""Time an INT4 decode layer at the models' own top-k under candidate down and gate/up launches.

The untuned configuration's launches were chosen by one expert's time (the autotune,
kernels_int4.py, adds the top-k layer's); a token's layer routes it to K experts (2 for
Mixtral, 6 or 8 for the small-expert models), each with down programs of its own
(KernelConfig.down_per_pair; results before it had one program walk the K in turn). Per expert
shape (random INT4 blobs, bf16 activations, one token, its K experts of 8 distinct blobs, from
HBM), on one GPU, in turns within each repeat: the
stored (or untuned) configuration, and the same with candidate launches that give a thread a
smaller share of a program's codes (fewer columns a warp; down's reduction over I split so that a
step is a program), down and gate/up alone and together. Each candidate is checked against the
float32 reference first. Figures are per call, --repeats repeats of the median of --replays CUDA-graph
replays (median and range), against the stored configuration in the same run; the decode's grids
and whether its down launch is a dependent one (mira.kernels.dependent) are recorded.

    python benchmarks/int4_layer_decode.py [--shapes qwen3-30b-a3b,...] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dependent_launch import TopKLayer, cell, cuda_run, layer_parser  # noqa: E402
from kernels_int4 import relative_error, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.kernels.triton_int4 import TritonInt4MoEFFN, decode_gemv, load_int4_config  # noqa: E402
from mira.kernels.tuning import GemvConfig  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402

SMALL = ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite")
# (block_cols, num_warps): fewer columns a warp than the untuned 256, so a thread walks a smaller
# share of a program's codes; down's reduction over I split so that a step is a program
DOWN_STEPS = ((1024, 8), (1024, 16), (512, 8), (256, 4))
UP_STEPS = ((2048, 16), (1024, 16))  # gate/up: unsplit, a row of H in steps of block_cols
# gate/up at rows longer than 2048 (Mixtral's 4096, top-2): 128 to 512 columns a warp on 2 to 8 warps a
# program; one expert has a top-k layer's programs over K
LONG_UP_STEPS = ((1024, 4), (2048, 8), (512, 4), (2048, 4), (512, 2))


def candidates(hidden: int, intermediate: int) -> dict[str, dict[str, GemvConfig]]:
    """label -> the KernelConfig fields a candidate replaces: each down and gate/up launch alone, and
    the first of each together."""
    down = {f"down {cols} cols, {warps} warps, split {math.ceil(intermediate / cols)}":
            {"down_gemv": decode_gemv(cols, warps, math.ceil(intermediate / cols))} for cols, warps in DOWN_STEPS}
    up_steps = UP_STEPS if hidden <= 2048 else LONG_UP_STEPS
    up = {f"gate/up {min(cols, hidden)} cols, {warps} warps": {"gate_up_gemv": decode_gemv(min(cols, hidden), warps)}
          for cols, warps in up_steps}
    (cols, warps), (up_cols, up_warps) = DOWN_STEPS[0], up_steps[0]
    both = f"down {cols}/{warps} + gate/up {min(up_cols, hidden)}/{up_warps} (cols/warps)"
    return down | up | {both: next(iter(down.values())) | next(iter(up.values()))}


def main() -> None:
    args = layer_parser(__doc__, ",".join(SMALL), "int4-layer-decode.json").parse_args()
    device, gpu, timer, result = cuda_run(args)
    rows = []
    for name in args.shapes.split(","):
        layer = TopKLayer(name, device, timer)
        layout, top_k, work = layer.layout, layer.top_k, layer.work
        hidden, intermediate = layout.hidden, layout.intermediate
        truth = layer.reference()
        stored = load_int4_config(gpu, hidden, intermediate)
        configs = {"stored": stored, **{label: dataclasses.replace(stored, **fields)
                                        for label, fields in candidates(hidden, intermediate).items()}}
        ffns, figures = {}, {"hidden": hidden, "intermediate": intermediate, "top_k": top_k, "launches": {}}
        for label, config in configs.items():
            ffn = TritonInt4MoEFFN(layout, device, config=config)
            _, up_grid, down_grid, dependent = ffn.decode_launches(1, top_k)
            error = relative_error(layer.call(ffn), truth)
            figures["launches"][label] = {"gate_up_gemv": dataclasses.asdict(config.gate_up_gemv),
                                          "down_gemv": dataclasses.asdict(config.down_gemv), "gate_up_grid": up_grid,
                                          "down_grid": down_grid, "dependent": dependent,
                                          "relative_error_vs_fp32_reference": error,
                                          "layer_s": [], "one_expert_s": []}
            if error < 2e-2:
                ffns[label] = ffn
        for _ in range(args.repeats):
            for label, ffn in ffns.items():
                entry = figures["launches"][label]
                entry["layer_s"].append(layer.time(ffn))
                entry["one_expert_s"].append(work.one_expert(ffn))
        base = {key: statistics.median(figures["launches"]["stored"][key]) for key in ("layer_s", "one_expert_s")}
        for label, entry in figures["launches"].items():
            if not entry["layer_s"]:
                error = entry["relative_error_vs_fp32_reference"]
                rows.append(f"{name:16} {top_k:5} {label:44} refused: error {error}")
                continue
            for key in ("layer_s", "one_expert_s"):
                entry[key.replace("_s", "_over_stored")] = statistics.median(entry[key]) / base[key]
                entry[key] = spread(entry[key])
            rows.append(f"{name:16} {top_k:5} {label:44} {'D' if entry['dependent'] else '-'}  "
                        + "  ".join(cell(entry, key, "stored") for key in ("layer_s", "one_expert_s")))
        result["shapes"][name] = figures
        del layer, work, ffns
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    print("shape            top-k launches" + " " * 37 + "D  top-k layer us [range] x stored   "
          "one expert us [range] x stored")
    print("\n".join(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
