"""One expert on the CPU (mira.kernels.cpu_experts) against its copy over PCIe, per model shape.

For each shape and scheme (both INT8 ones and int4) it builds synthetic expert blobs (random weights,
mira.bench.synthetic; int4's quantized on the GPU where there is one; page-locked with CUDA) spread over at least --spread-gb so that consecutive calls read distinct
weights that no CPU cache holds, and times on a CPU worker of --threads threads:

  cpu_us           one expert at each --tokens count, called in the worker's thread
  worker_us        the same as a job submitted from this thread and waited for (what the runtime sees)
  products_us      (INT8 schemes) the expert's two weight-only products alone, gate/up then down, in
                   the worker's thread: what of cpu_us the products take, the rest being the executor's
                   operations around them
  main_busy_us     (--main-threads M) cpu_us while this thread computes experts with M threads too
  copy_us          (CUDA) the pinned-to-device copy of one blob
  together         (CUDA) cpu_us while copies stream to the device, and the copies' GB/s meanwhile
  cuts             (--cuts N, one token) a job of one expert cut k/N of the way, for k = 1..N-1: the
                   CPU computes its last k/N of the intermediate units (mira.kernels.cpu_experts), as
                   worker_us and (CUDA) together; each against the cost model's linear price: the whole
                   expert's time scaled by the bytes the part costs to read, plus, for a job through
                   the worker, an empty job's round trip; and the part with its columns of the down
                   matrix against it with the whole matrix, whatever the executor would choose

Each figure: --repeats passes (>= 3), each the mean per call over one pass through the blobs;
median and range over the passes. Writes JSON with provenance (mira.bench.provenance).

    python benchmarks/cpu_experts.py --threads 16 [--shapes mixtral-8x7b,...] [--shape 512x1024] [--schemes int8-shared]
        [--tokens 1,4,16] [--repeats 5] [--main-threads 1] [--cuts 8] [--out benchmarks/results/cpu-experts.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mira.bench.provenance import result_header
from mira.bench.synthetic import PRESETS, preset_config, synthetic_store
from mira.cache.costmodel import Cuts
from mira.kernels.cpu_experts import VECTOR, CpuExpertFFN
from mira.models.registry import adapter_for
from mira.runtime.cpu_worker import CpuExpertWorker, CpuJob
from mira.store.layout import ExpertLayout
from mira.store.files import write_json_atomic
from mira.store.store import ExpertStore

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("int8-row", "int8-shared", "int4")
MAX_CALLS = 64  # per pass


def write_result(out: Path, figures: dict, device: str | None) -> None:
    """`figures` under this run's command, commit, machine and date, written atomically to `out`."""
    report = result_header("python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), device) | figures
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, report)
    print(f"wrote {out}")


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def shape_config(name: str):
    """A preset's config, or a Mixtral-style config of an ad hoc HxI expert shape (8 experts)."""
    if name in PRESETS:
        return preset_config(name)
    hidden, intermediate = (int(v) for v in name.lower().split("x"))
    config = preset_config("mixtral-8x7b")
    config.hidden_size, config.intermediate_size = hidden, intermediate
    return config


def layout_for(config, scheme: str) -> ExpertLayout:
    return ExpertLayout(scheme, config.hidden_size, adapter_for(config).spec.intermediate)


def blobs_for(config, layout: ExpertLayout, spread_bytes: float, pin: bool) -> tuple[ExpertStore, list[torch.Tensor]]:
    """At least two distinct synthetic blobs, `spread_bytes` of them in all (whole layers are made),
    and their store: keep it while the blobs are used, since collecting it unlocks their pages."""
    layers = max(1, math.ceil(spread_bytes / (adapter_for(config).spec.num_experts * layout.nbytes)))
    store = synthetic_store(config, layers, layout.scheme, pin=pin, progress=False,
                            device=torch.device("cuda") if pin else None)
    blobs = [store.blob(layer, e) for layer in range(layers) for e in range(store.num_experts)]
    return store, blobs[: max(2, math.ceil(spread_bytes / layout.nbytes))]


def time_pass(ffn: CpuExpertFFN, blobs: list[torch.Tensor], x: torch.Tensor, first: int = 0) -> float:
    """Mean seconds per expert (its units from `first` on) over one pass through distinct blobs (runs
    in the calling thread), each blob's views made once, as the runtime's executor keeps them."""
    calls = blobs[:MAX_CALLS]
    views = [ffn.views(blob) for blob in calls]
    start = time.perf_counter()
    for view in views:
        ffn.expert(x, view, first)
    return (time.perf_counter() - start) / len(calls)


def products_pass(layout: ExpertLayout, blobs: list[torch.Tensor], x: torch.Tensor) -> float:
    """Mean seconds per expert of its two INT8 products alone (torch's weight-only product, unit
    scales: the scales' arithmetic belongs to the executor) over one pass through distinct blobs. Both
    reductions must be multiples of VECTOR (the vectorised bf16 form the executor takes for them)."""
    w13_rows, w2_rows, intermediate = layout.sections["w13"].shape[0], layout.hidden, layout.intermediate
    views = [layout.views(blob) for blob in blobs[:MAX_CALLS]]
    unit13, unit2 = torch.ones(w13_rows, dtype=torch.bfloat16), torch.ones(w2_rows, dtype=torch.bfloat16)
    h = torch.randn(x.shape[0], intermediate).to(torch.bfloat16)  # [T, I]
    start = time.perf_counter()
    for view in views:
        torch._weight_int8pack_mm(x, view["w13"], unit13)
        torch._weight_int8pack_mm(h, view["w2"], unit2)
    return (time.perf_counter() - start) / len(views)


def worker_pass(worker: CpuExpertWorker, blobs: list[torch.Tensor], x: torch.Tensor, first: int = 0,
                empty: bool = False) -> float:
    """Mean seconds per one-expert job (its units from `first` on; `empty`: a job of no expert),
    submitted and waited for from this thread."""
    tokens = x.shape[0]
    index, weights = torch.zeros(tokens, 1, dtype=torch.int64), torch.ones(tokens, 1)
    out = torch.empty(tokens, x.shape[1])
    calls = blobs[:MAX_CALLS]
    start = time.perf_counter()
    for blob in calls:
        worker.submit(CpuJob(0, [] if empty else [0], x, index, weights, [blob], out,
                             cut=(0, first) if first else None)).result()
    return (time.perf_counter() - start) / len(calls)


def copy_pass(blobs: list[torch.Tensor], slot: torch.Tensor) -> float:
    """Mean seconds per pinned-to-device blob copy over one pass (CUDA events)."""
    calls = blobs[:MAX_CALLS]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for blob in calls:
        slot.copy_(blob, non_blocking=True)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / len(calls)


def together_pass(worker, blobs, x, slot, cpu_s: float, copy_s: float, first: int = 0,
                  ffn: CpuExpertFFN | None = None) -> tuple[float, float]:
    """(CPU seconds per expert, its units from `first` on, and copy bytes per second) with copies
    streaming while the worker's thread computes a pass (with `ffn`, else the worker's executor):
    enough copies, at the rate measured alone, to outlast the pass."""
    stream = torch.cuda.Stream()
    copies = max(8, math.ceil(1.5 * cpu_s * min(len(blobs), MAX_CALLS) / copy_s))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        begin.record()
        for i in range(copies):
            slot.copy_(blobs[-1 - i % len(blobs)], non_blocking=True)
        end.record()
    cpu = worker.call(time_pass, ffn or worker.ffn, blobs, x, first).result()
    end.synchronize()
    return cpu, copies * slot.numel() / (begin.elapsed_time(end) / 1e3)


def main_busy_pass(worker, blobs, x, main_threads: int) -> float:
    """The worker's pass while this thread computes experts with `main_threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(main_threads)
    try:
        future = worker.call(time_pass, worker.ffn, blobs, x)
        while not future.done():
            time_pass(worker.ffn, blobs[::-1][:4], x)
        return future.result()
    finally:
        torch.set_num_threads(before)


def cut_rows(worker, blobs, x, slot, whole: dict, args) -> dict:
    """One-token jobs of one expert cut k/N of the way (`args.cuts` = N), each as `worker_us` and with
    a GPU `together`, and each over its linear price as the cost model prices it: the share of the
    expert's bytes the part costs to read (`Cuts.cpu_read`: its rows of gate and up, and its columns
    of the down matrix or the whole matrix, as the executor reads it) times the whole
    expert's median in the worker's thread (`whole`: cpu_us, or together's), plus, for a job, an
    empty job's round trip (`call_us`). Beside each, the same part in the worker's thread both ways
    (`columns_us`: with its columns of W2 whatever the share; `whole_down_us`: with the whole W2),
    alone and with a GPU `together`: where reading the columns pays."""
    layout = worker.ffn.layout
    cuts = Cuts(2, layout.sections["w2"].nbytes / layout.nbytes, worker.ffn.column_cost)
    ways = {"columns": CpuExpertFFN(layout, F.silu, column_cost=1.0),
            "whole_down": CpuExpertFFN(layout, F.silu, column_cost=math.inf)}
    call = statistics.median([worker_pass(worker, blobs, x, empty=True) for _ in range(args.repeats)]) * 1e6
    rows = {"call_us": call}
    for k in range(1, args.cuts):
        share = k / args.cuts
        first = round(layout.intermediate * (1 - share))
        read = cuts.cpu_read((layout.intermediate - first) / layout.intermediate)
        alone = [worker_pass(worker, blobs, x, first) * 1e6 for _ in range(args.repeats)]
        cut = {"first": first, "bytes_read": round(read, 4), "worker_us": summary(alone),
               "worker_over_linear": statistics.median(alone) / (call + read * whole["cpu_us"]["median"])}
        if slot is not None:
            cpu_s, copy_s = whole["cpu_us"]["median"] / 1e6, whole["copy_us"]["median"] / 1e6
            both = [together_pass(worker, blobs, x, slot, cpu_s, copy_s, first)[0] * 1e6 for _ in range(args.repeats)]
            cut["together_cpu_us"] = summary(both)
            cut["together_over_linear"] = statistics.median(both) / (read * whole["together"]["cpu_us"]["median"])
        for way, ffn in ways.items():
            cut[f"{way}_us"] = summary([worker.call(time_pass, ffn, blobs, x, first).result() * 1e6
                                        for _ in range(args.repeats)])
            if slot is not None:
                both = [together_pass(worker, blobs, x, slot, cpu_s, copy_s, first, ffn)[0]
                        for _ in range(args.repeats)]
                cut[f"together_{way}_us"] = summary([s * 1e6 for s in both])
        cut["columns_over_whole_down"] = cut["columns_us"]["median"] / cut["whole_down_us"]["median"]
        if slot is not None:
            cut["together_columns_over_whole_down"] = \
                cut["together_columns_us"]["median"] / cut["together_whole_down_us"]["median"]
        rows[f"{k}/{args.cuts}"] = cut
    return rows


def measure(name: str, scheme: str, args, cuda: bool) -> dict:
    config = shape_config(name)
    ffn_layout = layout_for(config, scheme)
    store, blobs = blobs_for(config, ffn_layout, args.spread_gb * 1e9, pin=cuda)
    ffn = CpuExpertFFN(ffn_layout, F.silu)
    result: dict = {"hidden": ffn_layout.hidden, "intermediate": ffn_layout.intermediate,
                    "blob_bytes": ffn_layout.nbytes, "distinct_blobs": len(blobs), "tokens": {}}
    slot = torch.empty(ffn_layout.nbytes, dtype=torch.uint8, device="cuda") if cuda else None
    with CpuExpertWorker(ffn, args.threads) as worker:
        result["worker_threads"] = worker.threads
        result["own_threads"] = worker.own_threads
        for tokens in args.tokens:
            x = torch.randn(tokens, ffn_layout.hidden).to(torch.bfloat16)
            worker.call(time_pass, ffn, blobs[:2], x).result()  # first calls outside the timing
            cpu = [worker.call(time_pass, ffn, blobs, x).result() for _ in range(args.repeats)]
            row = {"cpu_us": summary([s * 1e6 for s in cpu]),
                   "cpu_gb_per_s": ffn_layout.nbytes / statistics.median(cpu) / 1e9,
                   "worker_us": summary([worker_pass(worker, blobs, x) * 1e6 for _ in range(args.repeats)])}
            if scheme.startswith("int8") and ffn_layout.hidden % VECTOR == ffn_layout.intermediate % VECTOR == 0:
                row["products_us"] = summary([worker.call(products_pass, ffn_layout, blobs, x).result() * 1e6
                                              for _ in range(args.repeats)])
            if args.main_threads:
                row["main_threads"] = args.main_threads
                row["main_busy_us"] = summary([main_busy_pass(worker, blobs, x, args.main_threads) * 1e6
                                               for _ in range(args.repeats)])
            if cuda:
                copy_pass(blobs[:2], slot)
                copies = [copy_pass(blobs, slot) for _ in range(args.repeats)]
                row["copy_us"] = summary([s * 1e6 for s in copies])
                row["copy_gb_per_s"] = ffn_layout.nbytes / statistics.median(copies) / 1e9
                both = [together_pass(worker, blobs, x, slot, statistics.median(cpu), statistics.median(copies))
                        for _ in range(args.repeats)]
                row["together"] = {"cpu_us": summary([c * 1e6 for c, _ in both]),
                                   "copy_gb_per_s": summary([b / 1e9 for _, b in both])}
            if args.cuts and tokens == 1:
                row["cuts"] = cut_rows(worker, blobs, x, slot, row, args)
            result["tokens"][str(tokens)] = row
    result["page_locked"] = store.data.is_pinned()  # the store lived through the copies (its pages locked)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="torch threads of the CPU worker")
    parser.add_argument("--shapes", default=",".join(PRESETS), help="comma-separated presets")
    parser.add_argument("--shape", action="append", default=[], help="an extra HxI expert shape (repeatable)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated quantization schemes")
    parser.add_argument("--tokens", default="1", help="comma-separated token counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spread-gb", type=float, default=1.0, help="distinct blob bytes cycled through")
    parser.add_argument("--main-threads", type=int, default=0, help="also time with this thread computing too")
    parser.add_argument("--cuts", type=int, default=0,
                        help="also time one-token jobs of an expert cut k/N of the way, k = 1..N-1 (N >= 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-experts.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (median and range)")
    unknown = set(args.schemes.split(",")) - set(SCHEMES)
    if unknown:
        parser.error(f"unknown scheme {', '.join(sorted(unknown))}; choose out of {', '.join(SCHEMES)}")
    if args.cuts == 1 or args.cuts < 0:
        parser.error("--cuts must be 0 (none) or at least 2 parts")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    names = [n for n in args.shapes.split(",") if n] + args.shape
    cuda = torch.cuda.is_available()
    results = {}
    for name in names:
        for scheme in args.schemes.split(","):
            started = time.perf_counter()
            entry = measure(name, scheme, args, cuda)
            results.setdefault(name, {})[scheme] = entry
            for tokens, row in entry["tokens"].items():
                line = f"{name:18s} {scheme:11s} T={tokens:>3s}  cpu {row['cpu_us']['median']:9.1f} us " \
                       f"({row['cpu_gb_per_s']:5.1f} GB/s)  worker {row['worker_us']['median']:9.1f} us"
                if "products_us" in row:
                    line += f"  products {row['products_us']['median']:8.1f} us"
                if cuda:
                    line += f"  copy {row['copy_us']['median']:8.1f} us ({row['copy_gb_per_s']:5.1f} GB/s)" \
                            f"  together cpu {row['together']['cpu_us']['median']:8.1f} us " \
                            f"copy {row['together']['copy_gb_per_s']['median']:5.1f} GB/s"
                print(line + f"  [{time.perf_counter() - started:.0f} s]", flush=True)
                for part, cut in row.get("cuts", {}).items():
                    if part == "call_us":
                        continue
                    line = f"{'':18s} {'':11s} cut {part:>5s}  worker {cut['worker_us']['median']:9.1f} us " \
                           f"({cut['worker_over_linear']:.2f}x linear; columns {cut['columns_over_whole_down']:.2f}x " \
                           f"the whole W2)"
                    if cuda:
                        line += f"  together cpu {cut['together_cpu_us']['median']:8.1f} us " \
                                f"({cut['together_over_linear']:.2f}x linear; columns " \
                                f"{cut['together_columns_over_whole_down']:.2f}x)"
                    print(line, flush=True)
    write_result(args.out, {"threads": args.threads, "spread_gb": args.spread_gb, "repeats": args.repeats,
                            "cuts": args.cuts, "results": results}, "cuda" if cuda else None)


if __name__ == "__main__":
    main()
