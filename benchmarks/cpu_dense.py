"""Where the CPU executor's dense products start to pay: one expert's time by its token count, and a
CPU-only prefill's time to first token (mira.kernels.cpu_experts.DENSE_TOKENS).

Per expert (synthetic blobs at a preset's shape, bf16 activations, the machine's torch threads),
three ways to compute it:

- weight-only: the executor with dense products switched off (INT8/INT4 weight-only matmuls, which
  read every weight again for each token);
- executor: the executor as shipped (an INT8 expert of DENSE_TOKENS tokens or more converted to bf16
  once, then dense products);
- reference: mira.kernels.reference in bf16 (the whole expert dequantized to bf16 at each call, then
  dense products): what a dense INT4 path would pay for its dequantization.

Below DENSE_TOKENS the first two run the same code, so their ratio there is the measurement's
noise. Each cell: the median and range of --repeats calls after an untimed one. Then a CPU-only prefill
(synthetic preset cut to --layers decoder layers, bf16, int8-shared, one prompt of --prompt-tokens
random ids): time to first token with and without dense products, median and range of --repeats
rounds after an untimed one, the two alternating.

    python benchmarks/cpu_dense.py [--presets olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_experts import summary, write_result  # noqa: E402

from mira.bench.measure import time_generation  # noqa: E402
from mira.bench.prompts import BenchPrompt  # noqa: E402
from mira.bench.synthetic import PRESETS, preset_config, synthetic_skeleton, synthetic_store  # noqa: E402
from mira.kernels import cpu_experts  # noqa: E402
from mira.kernels.cpu_experts import CpuExpertFFN  # noqa: E402
from mira.kernels.reference import expert_ffn  # noqa: E402
from mira.runtime.config import RuntimeConfig  # noqa: E402
from mira.runtime.engine import assemble  # noqa: E402

SCHEMES = ("int8-shared", "int8-row", "int4")
CELLS = ("weight-only", "executor", "reference")
SHIPPED = cpu_experts.DENSE_TOKENS


def dense_from(tokens: int | None) -> None:
    """Dense products from `tokens` on (None: never)."""
    cpu_experts.DENSE_TOKENS = sys.maxsize if tokens is None else tokens


def time_calls(fn, repeats: int) -> dict:
    """Milliseconds of `repeats` calls of fn after an untimed one."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return summary(runs)


def expert_times(name: str, scheme: str, tokens: list[int], repeats: int) -> dict:
    """{tokens: {cell: ms}} for one expert of preset `name`."""
    config = copy.deepcopy(preset_config(name))
    config.num_hidden_layers = 1
    store = synthetic_store(config, 1, scheme, pin=False, progress=False, name=name)
    layout = store.layout
    views = layout.views(store.blob(0, 0))
    executor = CpuExpertFFN(layout, F.silu)
    figures = {}
    for count in tokens:
        x = torch.randn(count, layout.hidden, generator=torch.Generator().manual_seed(count)).bfloat16()
        cells = {}
        dense_from(None)
        cells["weight-only"] = time_calls(lambda: executor.expert(x, views), repeats)
        dense_from(SHIPPED)
        cells["executor"] = time_calls(lambda: executor.expert(x, views), repeats)
        cells["reference"] = time_calls(lambda: expert_ffn(x, views, layout, F.silu), repeats)
        figures[str(count)] = cells
        print(f"{name} {scheme} T={count}: " + " | ".join(f"{c} {s['median']:.3f} ms" for c, s in cells.items()),
              flush=True)
    return figures


def prefill_times(name: str, layers: int, prompt_tokens: int, repeats: int) -> dict:
    """Time to first token in seconds of a CPU-only bf16 run, dense products on and off."""
    config = copy.deepcopy(preset_config(name))
    config.num_hidden_layers = layers
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    store = synthetic_store(config, layers, "int8-shared", pin=False, progress=False, name=name)
    skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"))
    model = assemble(skeleton.to(torch.bfloat16), sites, store, None, RuntimeConfig(device="cpu", progress=False))
    prompt = BenchPrompt(None, prompt_tokens, 2)
    runs = {"weight-only": [], "executor": []}
    for round_ in range(repeats + 1):
        for cell, tokens in (("weight-only", None), ("executor", SHIPPED)):
            dense_from(tokens)
            timing = time_generation(model.generate, [prompt], None, config.vocab_size, "cpu", random_continuation=True)
            if round_:
                runs[cell].append(timing.ttft_s[0])
    dense_from(SHIPPED)
    result = {cell: summary(values) for cell, values in runs.items()}
    print(f"{name}, {layers} layers, prefill of {prompt_tokens}: "
          + " | ".join(f"{c} {s['median']:.3f} s" for c, s in result.items()), flush=True)
    del model, store
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b",
                        help=f"synthetic presets out of {', '.join(PRESETS)}")
    parser.add_argument("--tokens", default="1,8,16,32,64,128,256", help="tokens per expert, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-preset", default="olmoe-1b-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-dense-cpu.json")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    experts = {name: {scheme: expert_times(name, scheme, tokens, args.repeats) for scheme in SCHEMES}
               for name in args.presets.split(",")}
    prefill = prefill_times(args.prefill_preset, args.layers, args.prompt_tokens, args.repeats)
    write_result(args.out, {"threads": torch.get_num_threads(), "dense_tokens": SHIPPED, "repeats": args.repeats,
                            "expert_ms": experts,
                            "prefill": {"preset": args.prefill_preset, "layers": args.layers,
                                        "prompt_tokens": args.prompt_tokens, "scheme": "int8-shared",
                                        "ttft_s": prefill}}, "cpu")
    print(_table(experts, prefill, args))


def _table(experts: dict, prefill: dict, args) -> str:
    lines = ["one expert, ms (median); weight-only / executor, and reference / weight-only",
             "| shape | scheme | tokens | weight-only | executor | reference | weight-only / executor |"
             " reference / weight-only |", "|---" * 8 + "|"]
    for name, schemes in experts.items():
        for scheme, per_tokens in schemes.items():
            for count, cells in per_tokens.items():
                w, e, r = (cells[c]["median"] for c in CELLS)
                lines.append(f"| {name} | {scheme} | {count} | {w:.3f} | {e:.3f} | {r:.3f} | {w / e:.2f}x "
                             f"| {r / w:.2f}x |")
    w, e = (prefill[c]["median"] for c in ("weight-only", "executor"))
    lines.append(f"\nprefill of {args.prompt_tokens} tokens, {args.prefill_preset} cut to {args.layers} layers: "
                 f"weight-only {w:.3f} s, executor {e:.3f} s ({w / e:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
