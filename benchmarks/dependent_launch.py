"""Time the INT4 decode launches with the down launch dependent on gate/up where that pays.

Per expert shape (random INT4 blobs, bf16 activations, batch 1), on one GPU, in turns within each
repeat: the stored (or untuned) configuration as ordinary launches (KernelConfig.dependent_launch
false) and as the runtime launches it (true: the down launch starts while gate/up runs, prefetching
its bytes, where both grids fit on the SMs; mira.kernels.dependent). Each is timed for one expert
from HBM, for a token's layer at the shape's top-k (its K experts of 8 distinct blobs, from HBM),
and for one expert read zero-copy from pinned host memory (a miss under a budget). Figures are per
call, --repeats repeats of the median of --replays CUDA-graph replays; the JSON keeps every repeat,
its median and range, and whether each call was dependent. Ratios are against the ordinary
launches of the same run. On a GPU without dependent launches the script says so and stops.

    python benchmarks/dependent_launch.py [--shapes mixtral-8x7b,...] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_int4 import (  # noqa: E402
    MODEL_TOP_K, SHAPES, Workload, addresses, make_inputs, random_int4_slots, spread,
)
from kernels_int8 import ROTATE_BYTES, Timer, random_slots  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import commit, context, machine, utc_now  # noqa: E402
from mira.kernels import dependent  # noqa: E402
from mira.kernels.reference import moe_ffn_reference  # noqa: E402
from mira.kernels.triton_int4 import TritonInt4MoEFFN, load_int4_config  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402

LAYER_BLOBS = 8  # distinct blobs a layer call's top-k experts are taken from
WAYS = {"ordinary": False, "dependent where it pays": True}  # KernelConfig.dependent_launch


class TopKLayer:
    """One shape's random blobs of a scheme (INT4 unless told) and one token routed to its top-k
    experts, LAYER_BLOBS distinct blobs a call, other blobs each call (rotating past the L2 cache);
    `one_expert` etc. on `work`."""

    def __init__(self, name: str, device: torch.device, timer: Timer, scheme: str = "int4") -> None:
        hidden, intermediate = SHAPES[name]
        self.top_k, self.timer = MODEL_TOP_K[name], timer
        gen = torch.Generator(device=device).manual_seed(0)
        self.layout = ExpertLayout(scheme, hidden, intermediate)
        count = max(LAYER_BLOBS, math.ceil(ROTATE_BYTES / self.layout.nbytes))
        self.slots = (random_int4_slots if scheme == "int4" else random_slots)(self.layout, count, device, gen)
        inputs = make_inputs(hidden, device, torch.bfloat16, min(64, count), gen, False, self.top_k)
        self.work = Workload(self.layout, self.slots, inputs, timer)
        self.x, self.calls = inputs["x1"], inputs["calls"]
        self.tables = [addresses([self.slots[(LAYER_BLOBS * c + e) % count] for e in range(LAYER_BLOBS)], device)
                       for c in range(self.calls)]
        self.index, self.weights = inputs["k_index"], inputs["k_weight"]
        self.out = torch.empty(1, hidden, dtype=torch.bfloat16, device=device)
        self._host_tables: list[torch.Tensor] | None = None  # pinned copies' tables (`zero_copy_time`)

    def call(self, ffn, c: int = 0, out: torch.Tensor | None = None, tables: list | None = None) -> torch.Tensor:
        """The layer's experts for call c's token and blobs (of `tables`, default the device slots')."""
        return ffn.forward_bases(self.x[c], self.index, self.weights, (tables or self.tables)[c], out=out)

    def reference(self) -> torch.Tensor:
        """Call 0's layer by the float32 PyTorch reference."""
        blobs = [self.slots[e] for e in range(LAYER_BLOBS)]  # call 0's table
        return moe_ffn_reference(self.x[0].float(), self.index, self.weights.float(), blobs, self.layout, F.silu)

    def time(self, ffn) -> float:
        """Seconds per layer call (CUDA graph replays over the rotating blobs)."""
        return self.timer.graph(lambda c: self.call(ffn, c, self.out), self.calls)

    def zero_copy_time(self, ffn) -> float:
        """Seconds per layer call with every routed expert read zero-copy from pinned host memory, as
        misses are under a budget (copies of the slots, rotating as they do)."""
        if self._host_tables is None:
            count = min(self.slots.shape[0], max(LAYER_BLOBS, math.ceil(ROTATE_BYTES / self.layout.nbytes)))
            self._host = torch.empty(count, self.layout.nbytes, dtype=torch.uint8, pin_memory=True)
            self._host.copy_(self.slots[:count])
            self._host_tables = [addresses([self._host[(LAYER_BLOBS * c + e) % count] for e in range(LAYER_BLOBS)],
                                           self.slots.device) for c in range(self.calls)]
        return self.timer.graph(lambda c: self.call(ffn, c, self.out, self._host_tables), self.calls)


def header(args: argparse.Namespace, device: torch.device) -> dict:
    """A result's provenance and setup, for a run of these layers with --repeats and --replays."""
    return {"command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
            "commit": commit(), "machine": machine(device), "gpu": torch.cuda.get_device_name(device),
            "date": utc_now(), **context(),
            "setup": {"activations": "bfloat16", "timing": f"{args.repeats} repeats, each the median of "
                      f"{args.replays} CUDA-graph replays over rotating blobs; per-call seconds",
                      "layer": f"one token, the shape's top-k experts of {LAYER_BLOBS} distinct blobs",
                      "sms": torch.cuda.get_device_properties(device).multi_processor_count}}


def cuda_run(args: argparse.Namespace, needs: str = "a CUDA GPU") -> tuple[torch.device, str, Timer, dict]:
    """What a run of these layers starts from: the CUDA device, its name, a Timer of --replays replays
    and the result's `header` with no shapes yet; without a GPU, exits saying it `needs` one."""
    if not torch.cuda.is_available():
        sys.exit(f"this benchmark times CUDA graphs: it needs {needs}")
    device = torch.device("cuda")
    result = {**header(args, device), "shapes": {}}
    return device, torch.cuda.get_device_name(device), Timer(device, args.replays), result


def layer_parser(doc: str, shapes: str, out_name: str) -> argparse.ArgumentParser:
    """The options the top-k layer benchmarks share: --shapes (default `shapes`), --repeats,
    --replays and --out (default `out_name` under benchmarks/results)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shapes", default=shapes, help="comma-separated: " + ", ".join(MODEL_TOP_K))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / out_name)
    return parser


def cell(entry: dict, key: str, base: str) -> str:
    """A row's timing: the median [range] in us of entry[key] (a `spread`) and its ratio to `base`
    (entry[key with "_s" made "_over_<base>"])."""
    timing = entry[key]
    return (f"{timing['median'] * 1e6:7.1f} [{timing['min'] * 1e6:.1f}, {timing['max'] * 1e6:.1f}] "
            f"x{entry[key.replace('_s', f'_over_{base}')]:.3f}")


def main() -> None:
    args = layer_parser(__doc__, ",".join(MODEL_TOP_K), "dependent-launch.json").parse_args()
    device, gpu, timer, result = cuda_run(args, "a CUDA GPU of compute capability 9.0 or later")
    if not dependent.supported_on(device):
        sys.exit("dependent launches need a CUDA GPU of compute capability 9.0 or later and Triton 3.4 or later")
    rows = []
    for name in args.shapes.split(","):
        layer = TopKLayer(name, device, timer)
        hidden, intermediate, top_k, work = layer.layout.hidden, layer.layout.intermediate, layer.top_k, layer.work
        stored = load_int4_config(gpu, hidden, intermediate)
        ffns = {way: TritonInt4MoEFFN(layer.layout, device,
                                      config=dataclasses.replace(stored, dependent_launch=flag))
                for way, flag in WAYS.items()}
        ordinary = layer.call(ffns["ordinary"]).clone()
        timed = {way: {"one_expert_s": [], "layer_s": [], "zero_copy_s": []} for way in ffns}
        for _ in range(args.repeats):
            for way, ffn in ffns.items():
                timed[way]["one_expert_s"].append(work.one_expert(ffn))
                timed[way]["layer_s"].append(layer.time(ffn))
                timed[way]["zero_copy_s"].append(work.zero_copy_time(ffn, False))
        base = {key: statistics.median(values) for key, values in timed["ordinary"].items()}
        figures = {"hidden": hidden, "intermediate": intermediate, "top_k": top_k, "config": stored.to_json(),
                   "ways": {}}
        for way, ffn in ffns.items():
            entry = {"dependent_one_expert": ffn.decode_launches(1, 1).dependent,
                     "dependent_layer": ffn.decode_launches(1, top_k).dependent,
                     "layer_same_output_as_ordinary": torch.equal(layer.call(ffn), ordinary),
                     **{key: spread(values) for key, values in timed[way].items()},
                     **{key.replace("_s", "_over_ordinary"): statistics.median(values) / base[key]
                        for key, values in timed[way].items()}}
            figures["ways"][way] = entry
            cells = [cell(entry, key, "ordinary") for key in ("one_expert_s", "layer_s", "zero_copy_s")]
            flags = f"{'D' if entry['dependent_one_expert'] else '-'}{'D' if entry['dependent_layer'] else '-'}"
            rows.append(f"{name:16} {top_k:5} {way:24} {flags:5} " + "  ".join(cells))
        result["shapes"][name] = figures
        del layer, work, ffns
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    print("shape            top-k launches                 D: dep.  one expert us [range] x ordinary   "
          "top-k layer us   zero-copy expert us")
    print("\n".join(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
