"""INT4 experts on a CPU whose torch INT4 matmul takes another layout than the store's tiles (x86
without AVX-512): the tiles dequantized by Mira's fallback against the codes rewritten into torch's
layout at load (mira.kernels.cpu_int4.adapt_codes), and what the rewrite costs.

Run it with torch held to AVX2 (the result's `cpu_capability` says which it ran under):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_int4_layout.py

Per preset shape (synthetic int4 blobs, bf16 activations): one expert's milliseconds at each token
count, median and range of --repeats calls after an untimed one, and the rewrite's milliseconds per
expert (a layer rewritten from the tiles, over its experts; median and range of --repeats). Then a
CPU-only decode (--decode-preset cut to --layers layers, bf16): tokens/s with the tiles and with the
codes rewritten, median and range of --repeats rounds after an untimed one, the two alternating.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_dense import time_calls  # noqa: E402
from cpu_experts import summary, write_result  # noqa: E402

from mira.bench.measure import time_generation  # noqa: E402
from mira.bench.prompts import BenchPrompt  # noqa: E402
from mira.bench.synthetic import preset_config, synthetic_skeleton, synthetic_store  # noqa: E402
from mira.kernels import CpuMoEFFN, cpu_int4  # noqa: E402
from mira.runtime.config import RuntimeConfig  # noqa: E402
from mira.runtime.engine import assemble  # noqa: E402
from mira.runtime.experts import MiraExperts  # noqa: E402

LAYOUTS = ("tiles", "torch")


def expert_times(name: str, tokens: list[int], repeats: int) -> dict:
    config = copy.deepcopy(preset_config(name))
    config.num_hidden_layers = 1
    store = synthetic_store(config, 1, "int4", pin=False, progress=False, name=name)
    layout = store.layout
    ffn = CpuMoEFFN(layout, F.silu)
    inputs = {t: torch.randn(t, layout.hidden, generator=torch.Generator().manual_seed(t)).bfloat16() for t in tokens}
    figures = {"tiles": {str(t): time_calls(lambda: ffn.executor.expert(inputs[t], layout.views(store.blob(0, 0))),
                                            repeats) for t in tokens}}
    tiles, rewrites = store.data.clone(), []
    for _ in range(repeats):  # each from the stored tiles
        store.data.copy_(tiles)
        store.codes_layout = "tiles"
        start = time.perf_counter()
        cpu_int4.adapt_codes(store)
        rewrites.append((time.perf_counter() - start) * 1e3 / store.num_experts)
    figures["rewrite_ms_per_expert"] = summary(rewrites)
    ffn.bind(store)  # the codes are torch's already: the executor that reads them
    figures["torch"] = {str(t): time_calls(lambda: ffn.executor.expert(inputs[t], layout.views(store.blob(0, 0))),
                                           repeats) for t in tokens}
    print(f"{name}: " + " | ".join(f"T={t} tiles {figures['tiles'][str(t)]['median']:.3f} ms, torch "
                                   f"{figures['torch'][str(t)]['median']:.3f} ms" for t in tokens)
          + f" | rewrite {figures['rewrite_ms_per_expert']['median']:.2f} ms/expert", flush=True)
    return figures


def decode_times(name: str, layers: int, repeats: int) -> dict:
    """Decode tokens/s of a CPU-only bf16 run, its experts read as tiles (an unbound executor, the
    store's stored bytes put back) and as rewritten codes (what `assemble` does)."""
    config = copy.deepcopy(preset_config(name))
    config.num_hidden_layers = layers
    models = {}
    for layout in LAYOUTS:
        store = synthetic_store(config, layers, "int4", pin=False, progress=False, name=name)
        skeleton, sites, _ = synthetic_skeleton(config, torch.device("cpu"))
        model = assemble(skeleton.bfloat16(), sites, store, None, RuntimeConfig(device="cpu", progress=False))
        if layout == "tiles":
            for module in model.hf_model.modules():
                if isinstance(module, MiraExperts):
                    module.ffn = CpuMoEFFN(store.layout, module.ffn.executor.act, module.ffn.executor.gate)
            store.data.copy_(synthetic_store(config, layers, "int4", pin=False, progress=False, name=name).data)
            store.codes_layout = "tiles"  # the blobs back in the stored tiles, read by an unbound executor
        models[layout] = model
    prompt = BenchPrompt(None, 16, 16)
    runs = {layout: [] for layout in LAYOUTS}
    for round_ in range(repeats + 1):
        for layout, model in models.items():
            timing = time_generation(model.generate, [prompt], None, config.vocab_size, "cpu", random_continuation=True)
            if round_:
                runs[layout].append(timing.decode_tokens / timing.decode_s)
    result = {layout: summary(values) for layout, values in runs.items()}
    print(f"{name}, {layers} layers, decode tokens/s: "
          + " | ".join(f"{c} {s['median']:.2f}" for c, s in result.items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="olmoe-1b-7b,qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-preset", default="olmoe-1b-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cpu-int4-layout-cpu-avx2.json")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    experts = {name: expert_times(name, tokens, args.repeats) for name in args.presets.split(",")}
    decode = decode_times(args.decode_preset, args.layers, args.repeats)
    write_result(args.out, {"threads": torch.get_num_threads(),
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "torch_reads_tiles": cpu_int4.torch_reads_blobs(), "repeats": args.repeats,
                            "expert_ms": experts,
                            "decode": {"preset": args.decode_preset, "layers": args.layers,
                                       "tokens_per_s": decode}}, "cpu")
    lines = ["| shape | tokens | tiles ms | torch layout ms | tiles / torch | rewrite ms per expert |",
             "|---|---|---|---|---|---|"]
    for name, figures in experts.items():
        for t in tokens:
            a, b = (figures[layout][str(t)]["median"] for layout in LAYOUTS)
            rewrite = figures["rewrite_ms_per_expert"]
            lines.append(f"| {name} | {t} | {a:.3f} | {b:.3f} | {a / b:.2f}x | {rewrite['median']:.2f} "
                         f"({rewrite['min']:.2f}-{rewrite['max']:.2f}) |")
    a, b = (decode[layout]["median"] for layout in LAYOUTS)
    lines.append(f"\ndecode, {args.decode_preset} cut to {args.layers} layers: tiles {a:.2f} tok/s, "
                 f"torch layout {b:.2f} tok/s ({b / a:.2f}x)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
