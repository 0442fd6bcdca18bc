"""Where a decode step's time goes, on the host and on the device (torch.profiler).

Loads the bundled model, or a synthetic one at real shapes (`--synthetic mixtral-8x7b`), and for
each budget and each `mira bench` configuration (mira+p, mira, lru, static, ...: the same names and
settings, mira.bench.configs.MIRA_CONFIGS) profiles one greedy `generate` call on one prompt from the
end of the prompt's forward on: a logits processor, called once the prompt's logits are ready,
waits for the device and starts the profiler, so the figures are the call's own `--steps` decode
steps: not the prompt's, whose expert kernels are grouped GEMMs that cost about ten decode layers
each, and no difference of two calls, which a stateful policy would start from different cache
states. A synthetic model decodes `mira bench`'s pseudo-random ids
(mira.bench.measure.RandomContinuation), as in the bench, since its own greedy output repeats one
token and its routing with it. Reports per decode step:

- wall time;
- host time inside Mira's pieces (record_function ranges around them): MiraExperts.forward
  (inclusive), cache.settle_layer (inline residency's read-back and policy work per layer),
  cache.settle (lagged residency's one read-back and policy work per step), staging's work before
  and after a layer, the predictor's scores, the FFN call, and with a CPU share its hand-off
  (hybrid.start) and the wait for its partial sum (hybrid.finish);
- host time blocked on the device (cudaStreamSynchronize: the per-layer read-back of routing);
- device time by kind: the expert kernels (Triton), host-to-device copies, everything else
  (attention, norms, router, embeddings, LM head);
- the device's busy time (the union of its kernels' and copies' spans, whatever the stream) and
  its idle time, the wall time less that: the bubbles the host's work and waits leave;
- with `--python-top N`, a second call's decode steps under cProfile: the N Python functions with
  the most time of their own (inflated by cProfile's own cost, so a ranking of where the host's
  time between the device's work goes, rather than a timing).

With `--routing TRACE.npz` every model routes as the trace did, as in `mira bench --routing`: the
calibration prompts replay its first rows and place the static policy and the mira policy's prior,
the profiled calls replay the rows after them; without it the placement is uniform.

Prints a table and writes benchmarks/results/profile-decode-<model>-<budgets>.json (or --out). On
the CPU the device columns are empty; run it on the GPU machine.

    python benchmarks/profile_decode.py --synthetic deepseek-v2-lite --budgets 8GiB --configs mira+p,mira,static
    python benchmarks/profile_decode.py --budgets all
    python benchmarks/profile_decode.py --synthetic mixtral-8x7b --budgets 25% --configs mira,static \
        --routing benchmarks/results/traces/mixtral-8x7b-instruct-decode.npz
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LogitsProcessor, LogitsProcessorList

from mira.bench.measure import RandomContinuation
from mira.bench.provenance import result_header
from mira.runtime.config import PrefetchConfig, RuntimeConfig
from mira.bench.configs import MIRA_CONFIGS
from mira.bench.run import (
    CALIBRATION_ROWS, UNLIMITED, _budget_bytes, calibration_placement, config_model, free_memory,
)
from mira.bench.sources import open_source
from mira.cache.policy import Popularity
from mira.errors import MiraError
from mira.runtime.engine import default_device
from mira.runtime.experts import MiraExperts
from mira.store.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
RANGES = ("MiraExperts.forward", "cache.settle_layer", "cache.settle", "staging.before_layer",
          "staging.after_layer", "predictor.scores", "ffn", "hybrid.start", "hybrid.finish")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _ranged(owner, attr: str, name: str) -> None:
    original = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        with record_function(name):
            return original(*args, **kwargs)

    setattr(owner, attr, wrapped)


def _instrument(model) -> None:
    layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    for name in ("settle_layer", "settle"):
        _ranged(model.cache, name, f"cache.{name}")
    if model.cache.staging is not None:
        for name in ("before_layer", "after_layer"):
            _ranged(model.cache.staging, name, f"staging.{name}")
    if layers[0].predictor is not None:
        _ranged(layers[0].predictor, "scores", "predictor.scores")
    ffn = layers[0].ffn  # one kernel object serves every layer
    if hasattr(ffn, "forward_bases"):
        _ranged(ffn, "forward_bases", "ffn")
    if layers[0].hybrid is not None:  # one object serves every layer
        for name in ("start", "finish"):
            _ranged(layers[0].hybrid, name, f"hybrid.{name}")
    for layer in layers:
        _ranged(layer, "forward", "MiraExperts.forward")
        if not hasattr(ffn, "forward_bases"):  # the reference FFN, called as `layer.ffn(...)`
            _ranged(layer, "ffn", "ffn")


def _decode(model, ids: torch.Tensor, steps: int, forced: LogitsProcessorList | None) -> torch.Tensor:
    """Greedy generation of steps + 1 tokens: the prompt's forward, then `steps` decode steps."""
    return model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, pad_token_id=0,
                          logits_processor=forced)


def _device_kind(name: str) -> str:
    if name.startswith(("_gate_up", "_down")):  # mira.kernels.triton_ffn's kernels
        return "expert kernels (Triton)"
    if "Memcpy HtoD" in name:
        return "host-to-device copies"
    return "other kernels"


class _FromFirstToken(LogitsProcessor):
    """Calls `start` once, when the prompt's logits are ready (the first processor call of a
    `generate`); leaves the scores as they are."""

    def __init__(self, start) -> None:
        self.start = start
        self.started = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.started:
            self.started = True
            self.start()
        return scores


def _profiled(model, ids: torch.Tensor, steps: int, forced, device: torch.device) -> tuple:
    """Profile one generate call's `steps` decode steps, from the end of its prompt's forward:
    (wall s, host ms by range, host ms blocked on the device, device ms by kind, device busy ms)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    began: list[float] = []

    def start() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the prompt's forward stays out of the profile
        prof.start()
        began.append(time.perf_counter())

    marker = LogitsProcessorList([_FromFirstToken(start), *(forced or [])])
    _decode(model, ids, steps, marker)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - began[0]
    prof.stop()
    busy = _busy_ms([(event.time_range.start, event.time_range.end) for event in prof.events()
                     if event.device_type != DeviceType.CPU and event.name not in RANGES])
    host: dict[str, float] = {}
    device_ms: dict[str, float] = defaultdict(float)
    blocked = 0.0
    for event in prof.key_averages():
        if event.device_type == DeviceType.CPU:  # host ops and ranges
            if event.key in RANGES:
                host[event.key] = event.cpu_time_total / 1e3
            if event.key in SYNCS:
                blocked += event.self_cpu_time_total / 1e3
        elif event.key not in RANGES:  # kernels and copies; not a host op's time on the device, which counts
            # its kernels again, nor a range's span on the device's timeline
            device_ms[_device_kind(event.key)] += event.self_device_time_total / 1e3
    return wall, host, blocked, dict(device_ms), busy


def _python_top(model, ids: torch.Tensor, steps: int, forced, device: torch.device, top: int) -> list[dict]:
    """One more generate call's `steps` decode steps under cProfile, from the end of its prompt's
    forward: the `top` functions by time of their own, per decode step."""
    profiler = cProfile.Profile()

    def start() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiler.enable()

    _decode(model, ids, steps, LogitsProcessorList([_FromFirstToken(start), *(forced or [])]))
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own s, total s, callers)
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": round(calls / steps, 2),
             "own_ms_per_step": round(own * 1e3 / steps, 3), "total_ms_per_step": round(total * 1e3 / steps, 3)}
            for (file, line, name), (_, calls, own, total, _) in ranked]


def _busy_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of (start, end) spans in microseconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def _profile_config(source, name: str, budget: int, total: int, placement: Popularity, context: int,
                    ids: torch.Tensor, steps: int, device: torch.device, python_top: int) -> dict:
    """One configuration's figures per decode step, or {"skipped": why}."""
    try:
        model = config_model(source, name, budget, placement, context)
    except MiraError as error:
        return {"skipped": str(error)}
    forced = LogitsProcessorList([RandomContinuation(source.config.vocab_size, 0)]) if (
        source.synthetic) else None
    _decode(model, ids, 4, forced)  # warm-up: kernels compiled, buffers made, cache filled, decode step captured
    _instrument(model)
    wall, host, blocked, device_ms, busy = _profiled(model, ids, steps, forced, device)
    timed = device.type == "cuda"  # the device's spans are profiled
    figures = {"wall_ms_per_step": round(wall * 1e3 / steps, 3),
               "device_busy_ms_per_step": round(busy / steps, 3) if timed else None,
               "device_idle_ms_per_step": round((wall * 1e3 - busy) / steps, 3) if timed else None,
               "host_ms_per_step": {k: round(v / steps, 3) for k, v in host.items()},
               "host_blocked_on_device_ms_per_step": round(blocked / steps, 3),
               "device_ms_per_step": {k: round(v / steps, 3) for k, v in device_ms.items()},
               "slots": model.cache.pool.num_slots, "total_experts": total,
               "residency": model.stats()["residency"],
               "decode_steps_replayed": model.decode_graphs.replays if model.decode_graphs else 0}
    if python_top:
        figures["python_top"] = _python_top(model, ids, steps, forced, device, python_top)
    del model
    free_memory(device)
    return figures


def _print(label: str, budget: str, name: str, figures: dict) -> None:
    if "skipped" in figures:
        print(f"{label}, budget {budget}, {name}: skipped ({figures['skipped']})")
        return
    print(f"{label}, budget {budget} ({figures['slots']} of {figures['total_experts']} experts in slots), {name} "
          f"({figures['residency']}), {figures['decode_steps_replayed']} decode steps replayed from CUDA graphs; "
          "per decode step:")
    print(f"  wall                               {figures['wall_ms_per_step']:9.3f} ms")
    for range_name in RANGES:
        if range_name in figures["host_ms_per_step"]:
            print(f"  host  {range_name:<28} {figures['host_ms_per_step'][range_name]:9.3f} ms")
    print(f"  host  blocked on the device        {figures['host_blocked_on_device_ms_per_step']:9.3f} ms")
    for kind, value in sorted(figures["device_ms_per_step"].items()):
        print(f"  device {kind:<27} {value:9.3f} ms")
    if figures["device_busy_ms_per_step"] is not None:
        print(f"  device busy (any stream)           {figures['device_busy_ms_per_step']:9.3f} ms")
        print(f"  device idle (wall less busy)       {figures['device_idle_ms_per_step']:9.3f} ms")
    if figures.get("python_top"):
        print("  under cProfile, per decode step: own ms, total ms, calls, function")
        for row in figures["python_top"]:
            print(f"    {row['own_ms_per_step']:8.3f} {row['total_ms_per_step']:8.3f} {row['calls_per_step']:7.1f}  "
                  f"{row['function']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or store (default: the bundled model)")
    parser.add_argument("--synthetic", help="a preset of mira.bench.synthetic instead")
    parser.add_argument("--budgets", default="all",
                        help="comma-separated budgets: 24GiB, 25%% (of the experts) or all (default)")
    parser.add_argument("--configs", default="mira",
                        help=f"comma-separated mira bench configurations out of {', '.join(MIRA_CONFIGS)} "
                             "(default mira)")
    parser.add_argument("--heads", help="trained predictor heads for mira+p (default: the store's own)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled (default 16)")
    parser.add_argument("--routing", help="a routing trace (.npz) to replay, as mira bench --routing: its first "
                                          "rows place the static policy and mira's prior, the profiled calls replay "
                                          "the next")
    parser.add_argument("--python-top", type=int, default=0, metavar="N",
                        help="also profile a second call under cProfile and report the N functions with the "
                             "most time of their own (default 0: not)")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--out", type=Path, help="the JSON to write (default benchmarks/results/profile-decode-"
                                                  "<model>-<budgets>.json)")
    args = parser.parse_args()
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in MIRA_CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {', '.join(unknown)}; choose out of {', '.join(MIRA_CONFIGS)}")

    device = torch.device(args.device)
    source = open_source(args.model, args.synthetic, device, progress=False, routing=args.routing)
    source.open_store(None)
    source.heads = args.heads
    context = max(args.prompt_tokens + 2 * args.steps + 8, CALIBRATION_ROWS)
    probe = source.mira(RuntimeConfig(vram_budget=UNLIMITED, max_context=context, prefetch=PrefetchConfig("off")), None)
    reserve = probe.plan.reserve_bytes if probe.plan else 0
    total = probe.store.num_layers * probe.store.num_experts
    all_bytes = reserve + total * probe.store.blob_bytes
    placement = Popularity((1,) * total, 1)  # uniform
    if source.trace is not None:  # the bench's calibration on the trace's first rows, then the rows after them
        placement = calibration_placement(source, probe, device)
        source.replay_from = CALIBRATION_ROWS
    del probe
    ids = torch.randint(5, source.config.vocab_size, (1, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(0)).to(device)
    runs = []
    for label in args.budgets.split(","):
        budget = _budget_bytes(label, reserve, total, source.store.blob_bytes, all_bytes)
        for name in configs:
            figures = _profile_config(source, name, budget, total, placement, context, ids, args.steps, device,
                                      args.python_top)
            _print(source.label, label, name, figures)
            runs.append({"budget": label, "config": name, **figures})
    model_name = args.synthetic or Path(args.model or "mira-tiny-moe").name
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"profile-decode-{model_name}-{args.budgets.replace('%', 'pct').replace(',', '-')}.json")
    write_json_atomic(out, {
        **result_header("python benchmarks/profile_decode.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None), device),
        "routing": source.routing, "setup": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
