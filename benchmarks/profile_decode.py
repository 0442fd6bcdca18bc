"""Where a decode step's time goes, on the host and on the device (torch.profiler).

Loads the bundled model, or a synthetic one at real shapes (`--synthetic mixtral-8x7b`), at one
budget, and profiles two greedy `generate` calls on one prompt: the prompt alone (one new token),
and the prompt then `--steps` decode steps. Their difference over `--steps` is one decode step,
free of the prompt's forward, whose expert kernels are grouped GEMMs that cost about ten decode
layers each (before this subtraction, profile-decode-mixtral-8x7b-all.json at 31a53f5 counted
them in). Reports per decode step:

- wall time;
- host time inside Mira's pieces (record_function ranges around them): MiraExperts.forward
  (inclusive), cache.fetch, cache.stage, cache.after_layer, the predictor's scores, the FFN call;
- host time blocked on the device (cudaStreamSynchronize: the per-layer read-back of routing);
- device time by kind: the expert kernels (Triton), host-to-device copies, everything else
  (attention, norms, router, embeddings, LM head).

Prints a table and writes benchmarks/results/profile-decode-<model>-<budget>.json. On the CPU the
device columns are empty; run it on the GPU machine.

    python benchmarks/profile_decode.py --synthetic mixtral-8x7b --budget 24GiB
    python benchmarks/profile_decode.py --budget all
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mira.bench.run import UNLIMITED, _budget_bytes
from mira.bench.sources import open_source
from mira.runtime.engine import default_device
from mira.runtime.experts import MiraExperts
from mira.bench.provenance import result_header

ROOT = Path(__file__).resolve().parent.parent
RANGES = ("MiraExperts.forward", "cache.fetch", "cache.stage", "cache.after_layer", "predictor.scores", "ffn")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _ranged(owner, attr: str, name: str) -> None:
    original = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        with record_function(name):
            return original(*args, **kwargs)

    setattr(owner, attr, wrapped)


def _instrument(model) -> None:
    layers = [m for m in model.hf_model.modules() if isinstance(m, MiraExperts)]
    for name in ("fetch", "stage", "after_layer"):
        _ranged(model.cache, name, f"cache.{name}")
    if layers[0].predictor is not None:
        _ranged(layers[0].predictor, "scores", "predictor.scores")
    ffn = layers[0].ffn  # one kernel object serves every layer
    if hasattr(ffn, "forward_bases"):
        _ranged(ffn, "forward_bases", "ffn")
    for layer in layers:
        _ranged(layer, "forward", "MiraExperts.forward")
        if not hasattr(ffn, "forward_bases"):  # the reference FFN, called as `layer.ffn(...)`
            _ranged(layer, "ffn", "ffn")


def _decode(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy generation of steps + 1 tokens: the prompt's forward, then `steps` decode steps."""
    return model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, pad_token_id=0)


def _device_kind(name: str) -> str:
    if name.startswith(("_gate_up", "_down")):  # mira.kernels.triton_ffn's kernels
        return "expert kernels (Triton)"
    if "Memcpy HtoD" in name:
        return "host-to-device copies"
    return "other kernels"


def _profiled(model, ids: torch.Tensor, steps: int, device: torch.device) -> tuple:
    """Profile one generate call of the prompt and `steps` decode steps: (wall s, host ms by range,
    host ms blocked on the device, device ms by kind)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        _decode(model, ids, steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    host: dict[str, float] = {}
    device_ms: dict[str, float] = defaultdict(float)
    blocked = 0.0
    for event in prof.key_averages():
        if event.key in RANGES:
            host[event.key] = event.cpu_time_total / 1e3
        if event.key in SYNCS:
            blocked += event.self_cpu_time_total / 1e3
        device_time = getattr(event, "self_device_time_total", 0) or 0
        if device_time and event.key not in RANGES:
            device_ms[_device_kind(event.key)] += device_time / 1e3
    return wall, host, blocked, dict(device_ms)


def _per_step(whole: dict[str, float], prompt: dict[str, float], steps: int) -> dict[str, float]:
    return {key: (value - prompt.get(key, 0.0)) / steps for key, value in whole.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or store (default: the bundled model)")
    parser.add_argument("--synthetic", help="a preset of mira.bench.synthetic instead")
    parser.add_argument("--budget", default="all", help="24GiB, 25%% (of the experts) or all (default)")
    parser.add_argument("--policy", default="mira")
    parser.add_argument("--prefetch", default="auto")
    parser.add_argument("--heads", help="trained predictor heads for --prefetch trained/auto (default: the store's own)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled (default 16)")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--residency", default="auto", help="auto (default), lagged or inline (mira.load)")
    parser.add_argument("--eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    args = parser.parse_args()

    device = torch.device(args.device)
    source = open_source(args.model, args.synthetic, device, progress=False)
    source.heads = args.heads
    context = args.prompt_tokens + 2 * args.steps + 8
    probe = source.mira(UNLIMITED, "mira", "off", None, context)
    reserve = probe.plan.reserve_bytes if probe.plan else 0
    total = probe.store.num_layers * probe.store.num_experts
    all_bytes = reserve + total * probe.store.blob_bytes
    del probe
    budget = _budget_bytes(args.budget, reserve, total, source.store.blob_bytes, all_bytes)
    model = source.mira(budget, args.policy, args.prefetch, [1] * total if args.policy == "static" else None,
                        context, args.residency)
    if args.eager and model.decode_graphs is not None:
        model.use_cuda_graphs(False)
    ids = torch.randint(5, source.config.vocab_size, (1, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(0)).to(device)
    _decode(model, ids, 4)  # warm-up: kernels compiled, buffers made, cache filled, decode step captured
    _instrument(model)
    prompt = _profiled(model, ids, 0, device)
    whole = _profiled(model, ids, args.steps, device)
    wall, blocked = ((whole[i] - prompt[i]) / args.steps for i in (0, 2))
    host, device_ms = (_per_step(whole[i], prompt[i], args.steps) for i in (1, 3))
    figures = {"wall_ms_per_step": round(wall * 1e3, 3),
               "host_ms_per_step": {k: round(v, 3) for k, v in host.items()},
               "host_blocked_on_device_ms_per_step": round(blocked, 3),
               "device_ms_per_step": {k: round(v, 3) for k, v in device_ms.items()},
               "slots": model.cache.pool.num_slots, "total_experts": total,
               "decode_steps_replayed": model.decode_graphs.replays if model.decode_graphs else 0}
    print(f"{source.label}, budget {args.budget} ({figures['slots']} of {total} experts in slots), "
          f"policy {args.policy}, prefetch {args.prefetch}, {figures['decode_steps_replayed']} decode steps "
          "replayed from CUDA graphs; per decode step:")
    print(f"  wall                               {figures['wall_ms_per_step']:9.3f} ms")
    for name in RANGES:
        if name in host:
            print(f"  host  {name:<28} {host[name]:9.3f} ms")
    print(f"  host  blocked on the device        {blocked:9.3f} ms")
    for name, value in sorted(device_ms.items()):
        print(f"  device {name:<27} {value:9.3f} ms")
    label = (args.synthetic or Path(args.model or "mira-tiny-moe").name) + "-" + args.budget.replace("%", "pct") + (
        f"-{args.residency}" if args.residency != "auto" else "") + ("-eager" if args.eager else "") + (
        f"-{args.prefetch}" if args.prefetch not in ("auto", "off") else "")
    out = ROOT / "benchmarks" / "results" / f"profile-decode-{label}.json"
    out.write_text(json.dumps({
        **result_header("python benchmarks/profile_decode.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None), device),
        "routing": source.routing, "setup": vars(args), "figures": figures}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
