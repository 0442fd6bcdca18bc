"""A CPU-only run's decode speed in float32 (exact, the reference expert FFN) against bfloat16 (experts
through the CPU executor, mira.kernels.CpuMoEFFN): the measurement behind the CPU's default dtype
(mira.runtime.config.default_dtype).

Three cells per model: float32 with the reference, bfloat16 with the reference (each routed expert
converted to bf16 before its products), and bfloat16 with the executor (weight-only products on the
INT8 bytes); the middle one separates the dtype's gain from the executor's. Models: the bundled
model, whole, and synthetic presets (random weights and routing, int8-shared experts) cut to L and
2L decoder layers, as a whole preset does not fit in a small machine's memory. The two depths give
a decoder layer's time per token, (t(2L) - t(L)) / L from the medians, and the rest (embedding,
head, sampling), t(L) - L x that; `estimate_full_model` adds the preset's layer count of them up
to the whole model's tokens/s, an estimate, labelled so.

Each cell: decode tokens/s at batch 1 of one prompt of --prompt-tokens random ids and --new-tokens
forced pseudo-random ones (mira.bench.measure); median and range of --repeats rounds after an
untimed one, every cell of a depth timed once per round, so that a machine drifting over the run
shifts all cells alike.

    python benchmarks/cpu_only_dtype.py [--presets olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b] [--out FILE]

For a CPU without bf16 instructions, hold torch to AVX2 (`cpu_capability` in the result says which):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_only_dtype.py \
        --out benchmarks/results/cpu-only-dtype-cpu-avx2.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import summary, write_result  # noqa: E402

import mira  # noqa: E402
from mira.bench.measure import time_generation  # noqa: E402
from mira.bench.prompts import BenchPrompt  # noqa: E402
from mira.bench.synthetic import PRESETS, preset_config, synthetic_skeleton, synthetic_store  # noqa: E402
from mira.kernels import CpuMoEFFN, ReferenceMoEFFN  # noqa: E402
from mira.runtime.config import RuntimeConfig  # noqa: E402
from mira.runtime.engine import assemble  # noqa: E402
from mira.runtime.experts import MiraExperts  # noqa: E402

CELLS = (("float32", "reference"), ("bfloat16", "reference"), ("bfloat16", "executor"))
DEPTHS = {"mixtral-8x7b": 2}  # L per preset (default DEFAULT_DEPTH): its experts are 176 MB each
DEFAULT_DEPTH = 4


def with_reference_ffn(model):
    """`model` with every MoE layer's FFN the reference, whatever its dtype."""
    for module in model.hf_model.modules():
        if isinstance(module, MiraExperts) and isinstance(module.ffn, CpuMoEFFN):
            executor = module.ffn.executor
            module.ffn = ReferenceMoEFFN(executor.layout, executor.act, executor.gate, module.ffn.absent_zero)
    return model


def bundled_model(dtype: str, ffn: str):
    model = mira.load(device="cpu", dtype=dtype, progress=False)
    return with_reference_ffn(model) if ffn == "reference" else model


def synthetic_model(config, store, dtype: str, ffn: str):
    skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"))
    model = assemble(skeleton.to(getattr(torch, dtype)), sites, store, None, RuntimeConfig(device="cpu", progress=False))
    return with_reference_ffn(model) if ffn == "reference" else model


def time_cells(models: dict, vocab_size: int, prompt: BenchPrompt, tokenizer, repeats: int) -> dict:
    """Decode tokens/s of each model: one untimed round, then `repeats` rounds of one run each."""
    runs = {cell: [] for cell in models}
    for round_ in range(repeats + 1):
        for cell, model in models.items():
            timing = time_generation(model.generate, [prompt], tokenizer, vocab_size, "cpu",
                                     random_continuation=True)
            if round_:
                runs[cell].append(timing.decode_tokens / timing.decode_s)
    return {cell: summary(values) for cell, values in runs.items()}


def label(cell: tuple[str, str]) -> str:
    return f"{cell[0]}, {cell[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b",
                        help=f"synthetic presets out of {', '.join(PRESETS)}, or none")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-only-dtype-cpu.json")
    args = parser.parse_args()
    prompt = BenchPrompt(None, args.prompt_tokens, args.new_tokens)
    results = {}

    models = {cell: bundled_model(*cell) for cell in CELLS}
    any_model = next(iter(models.values()))
    vocab = any_model.hf_model.config.vocab_size
    results["mira-tiny-moe"] = {"layers": any_model.hf_model.config.num_hidden_layers,
                                "tokens_per_s": {label(c): s for c, s in
                                                 time_cells(models, vocab, prompt, None, args.repeats).items()}}
    print(f"mira-tiny-moe: {_row(results['mira-tiny-moe']['tokens_per_s'])}", flush=True)
    del models, any_model
    gc.collect()  # a model holds reference cycles: freed only by the collector, before the next are built

    for name in [p for p in args.presets.split(",") if p and p != "none"]:
        depth = DEPTHS.get(name, DEFAULT_DEPTH)
        per_depth = {}
        for layers in (depth, 2 * depth):
            config = copy.deepcopy(preset_config(name))
            config.num_hidden_layers = layers
            if hasattr(config, "first_k_dense_replace"):
                config.first_k_dense_replace = 0  # every layer MoE, so the two depths differ in MoE layers only
            store = synthetic_store(config, layers, "int8-shared", pin=False, progress=False, name=name)
            models = {cell: synthetic_model(config, store, *cell) for cell in CELLS}
            per_depth[layers] = {label(c): s for c, s in
                                 time_cells(models, config.vocab_size, prompt, None, args.repeats).items()}
            print(f"{name}, {layers} layers: {_row(per_depth[layers])}", flush=True)
            del models, store
            gc.collect()
        results[name] = {"layers": {str(k): {"tokens_per_s": v} for k, v in per_depth.items()},
                         "estimate_full_model": _estimate(per_depth, depth, preset_config(name).num_hidden_layers)}

    write_result(args.out, {"threads": torch.get_num_threads(),
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                            "repeats": args.repeats, "scheme": "int8-shared", "models": results}, "cpu")
    print(_table(results))


def _estimate(per_depth: dict, depth: int, full_layers: int) -> dict:
    """Per cell: ms per token of one decoder layer and of the rest, and the whole model's tokens/s,
    from the medians at `depth` and 2 x `depth` layers."""
    estimate = {}
    for cell in per_depth[depth]:
        short, deep = (1e3 / per_depth[d][cell]["median"] for d in (depth, 2 * depth))  # ms per token
        layer_ms = (deep - short) / depth
        rest_ms = short - depth * layer_ms
        estimate[cell] = {"layer_ms": round(layer_ms, 3), "rest_ms": round(rest_ms, 3), "layers": full_layers,
                          "tokens_per_s": round(1e3 / (rest_ms + full_layers * layer_ms), 3)}
    return estimate


def _row(cells: dict) -> str:
    return " | ".join(f"{cell}: {s['median']:.2f} tok/s ({min(s['runs']):.2f}-{max(s['runs']):.2f})"
                      for cell, s in cells.items())


def _table(results: dict) -> str:
    cells = [label(c) for c in CELLS]
    lines = ["| model | " + " | ".join(cells) + " | bf16 executor / float32 |", "|---" * (len(cells) + 2) + "|"]
    for name, result in results.items():
        rows = [(f"{name} ({result['layers']} layers)", result["tokens_per_s"])] if "tokens_per_s" in result else \
            [(f"{name} ({n} layers)", v["tokens_per_s"]) for n, v in result["layers"].items()]
        for title, figures in rows:
            medians = [figures[c]["median"] for c in cells]
            lines.append(f"| {title} | " + " | ".join(f"{m:.2f}" for m in medians) + f" | {medians[2] / medians[0]:.2f}x |")
        if "estimate_full_model" in result:
            estimate = [result["estimate_full_model"][c]["tokens_per_s"] for c in cells]
            layers = result["estimate_full_model"][cells[0]]["layers"]
            lines.append(f"| {name}, whole ({layers} layers; estimate) | " + " | ".join(f"{e:.2f}" for e in estimate)
                         + f" | {estimate[2] / estimate[0]:.2f}x |")
    return "decode tokens/s, median of the repeats\n" + "\n".join(lines)


if __name__ == "__main__":
    main()
