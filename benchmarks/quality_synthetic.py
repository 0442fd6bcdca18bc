"""KL divergence and top-1 agreement of int8-shared, int8-row and int4 experts against bf16 experts, for a
synthetic model at a published model's shapes (default Mixtral-8x7B; paper Table I at scale).

Random weights have no outliers, unlike trained ones, so this understates the error of real
checkpoints: it checks that the schemes and kernels hold up at full size, not what a real model loses.
The expert weights are drawn once per expert (normal, std 0.02, rounded to bf16), from a seed per
(layer, expert), so every model gets the same weights; the non-expert weights are the synthetic
skeleton's (mira.bench.synthetic), the same for every model. The reference is transformers' own
Experts modules holding the bf16 weights on the device (no host copy); each INT8 scheme is the
store's own quantization (mira.store.quant) in a host store run through Mira's runtime with every
expert resident. One model is built, run over the same random token ids and freed before the
next, so host memory holds one INT8 store at most (half the bf16 experts' bytes). Every INT8
scheme is compared with the reference token by token (mira.eval.ppl.SchemeTotals; perplexity is
left out, the ids being random).

    python benchmarks/quality_synthetic.py                                    # the H200: every layer
    python benchmarks/quality_synthetic.py --layers 1 --tokens 16 --sequences 2 --device cpu --out /tmp/q.json  # smoke
"""

from __future__ import annotations

import argparse
import gc
import importlib
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import result_header  # noqa: E402
from mira.bench.hf import compute_dtype  # noqa: E402
from mira.bench.synthetic import PRESETS, WEIGHT_STD, preset_config, synthetic_skeleton  # noqa: E402
from mira.eval.ppl import SchemeTotals, model_log_probs  # noqa: E402
from mira.models.loader import moe_skeleton_layers  # noqa: E402
from mira.models.registry import adapter_for  # noqa: E402
from mira.runtime.config import RuntimeConfig
from mira.runtime.engine import assemble, default_device  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.store.manifest import FORMAT_VERSION, Manifest  # noqa: E402
from mira.store.quant import quantize_expert  # noqa: E402
from mira.store.store import ExpertStore, host_buffer  # noqa: E402

REFERENCE = "none"
SCHEMES = ("int8-shared", "int8-row", "int4")
LABEL = ("synthetic model: random weights (normal, std 0.02) have no outliers, so the error of real checkpoints is "
         "larger; synthetic routing")


def expert_weights(config, layer: int, expert: int, seed: int, device: torch.device):
    """The bf16 weights of one expert, w13 [2I, H] and w2 [H, I], the same on every call."""
    hidden, intermediate = config.hidden_size, adapter_for(config).spec.intermediate
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + layer * 1009 + expert)
    w13 = torch.randn(2 * intermediate, hidden, generator=generator, device=device).mul_(WEIGHT_STD)
    w2 = torch.randn(hidden, intermediate, generator=generator, device=device).mul_(WEIGHT_STD)
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def build_store(config, num_layers: int, scheme: str, seed: int, device: torch.device, progress: bool) -> ExpertStore:
    """Every expert's weights in `scheme`, quantized on `device`, in host memory [L, E, B]."""
    adapter = adapter_for(config)
    weight_dtype = torch.bfloat16 if scheme == REFERENCE else torch.int8
    layout = ExpertLayout(scheme, config.hidden_size, adapter.spec.intermediate, weight_dtype)
    num_experts = adapter.spec.num_experts
    data = host_buffer((num_layers, num_experts, layout.nbytes))  # [L, E, B]
    for layer in tqdm(range(num_layers), desc=f"{scheme} experts", unit="layer", disable=not progress):
        for expert in range(num_experts):
            w13, w2 = expert_weights(config, layer, expert, seed, device)
            with torch.device(device):  # the reference quantization's temporaries on the device too
                layout.pack(quantize_expert(w13, w2, layout), data[layer, expert])
    manifest = Manifest(FORMAT_VERSION, config.model_type, "synthetic:quality", f"synthetic:quality:{seed}",
                        list(range(num_layers)), num_experts, layout.to_json(), files={})
    return ExpertStore(Path(f"<synthetic {scheme}>"), manifest, data)


def reference_model(config, seed: int, device: torch.device, progress: bool):
    """The synthetic skeleton with transformers' own Experts modules in its MoE sites, holding the
    bf16 expert weights (in the skeleton's dtype) on `device`."""
    hf_model, sites, _ = synthetic_skeleton(config, device, seed)
    adapter = adapter_for(config)
    experts_class = getattr(importlib.import_module(adapter.experts_module), adapter.experts_class)
    for layer, site in enumerate(tqdm(sites, desc=f"{REFERENCE} experts", unit="layer", disable=not progress)):
        with torch.device("meta"):
            experts = experts_class(hf_model.config).to(hf_model.dtype)
        experts = experts.to_empty(device=device).eval()
        with torch.no_grad():
            for expert in range(experts.gate_up_proj.shape[0]):  # [E, 2I, H] and [E, H, I]
                w13, w2 = expert_weights(config, layer, expert, seed, device)
                experts.gate_up_proj[expert].copy_(w13)
                experts.down_proj[expert].copy_(w2)
        setattr(site.parent, site.attr, experts)
    return hf_model


def scheme_log_probs(config, num_layers: int, scheme: str, ids: torch.Tensor, seed: int, device: torch.device,
                     progress: bool) -> tuple[list[torch.Tensor], dict]:
    """Next-token log-probabilities [S, V] of every sequence of `ids` [N, S] (on the CPU), and the
    seconds spent building and running: the reference, or `scheme` with every expert resident."""
    start = time.perf_counter()
    if scheme == REFERENCE:
        model = reference_model(config, seed, device, progress)
    else:
        store = build_store(config, num_layers, scheme, seed, device, progress)
        hf_model, sites, _ = synthetic_skeleton(config, device, seed)
        model = assemble(hf_model, sites, store, None, RuntimeConfig(max_context=ids.shape[1]))
        if device.type == "cuda" and not model.all_resident:
            raise SystemExit(f"{scheme}: only {model.cache.pool.num_slots} of {num_layers * store.num_experts} experts "
                             f"fit on the device; this benchmark compares schemes with every expert resident")
        del store, hf_model, sites
    built = time.perf_counter()
    forward = model_log_probs(model)
    log_probs = [forward(sequence).cpu() for sequence in ids]
    seconds = {"build_s": round(built - start, 1), "run_s": round(time.perf_counter() - built, 1)}
    del model, forward
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return log_probs, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mixtral-8x7b")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's; fewer for a smoke test)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences of random ids (default 4)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--out", type=Path, help="the JSON result (default benchmarks/results/quality-synthetic-"
                                                 "PRESET.json)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()

    device = torch.device(args.device or default_device())
    config = preset_config(args.preset)
    if args.layers:
        config.num_hidden_layers = args.layers
    num_layers = len(moe_skeleton_layers(config))
    ids = torch.randint(0, config.vocab_size, (args.sequences, args.tokens),
                        generator=torch.Generator().manual_seed(args.seed))  # [N, S]
    targets = ids[:, 1:]

    reference, timings = scheme_log_probs(config, num_layers, REFERENCE, ids, args.seed, device, not args.quiet)
    reference = [r[:-1] for r in reference]  # [S - 1, V]: the last position predicts nothing here
    reference_totals = SchemeTotals()
    for log_probs, target in zip(reference, targets):
        reference_totals.add(log_probs, target, log_probs)
    figures, seconds = {}, {REFERENCE: timings}
    for scheme in SCHEMES:
        log_probs, seconds[scheme] = scheme_log_probs(config, num_layers, scheme, ids, args.seed, device,
                                                      not args.quiet)
        totals = SchemeTotals()
        for scheme_lp, reference_lp, target in zip(log_probs, reference, targets):
            totals.add(scheme_lp[:-1], target, reference_lp)
        summary = totals.summary(reference_totals)
        figures[scheme] = {key: summary[key] for key in ("mean_kl", "max_kl", "top1_agreement")}
        print(f"{scheme}: mean KL {summary['mean_kl']:.5f} nats, max {summary['max_kl']:.4f}, top-1 agreement "
              f"{100 * summary['top1_agreement']:.2f}% over {totals.tokens} tokens", file=sys.stderr)

    command = "python " + shlex.join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
                                      else sys.argv[0], *sys.argv[1:]])
    result = result_header(command, device) | {
        "label": LABEL, "preset": args.preset, "decoder_layers": config.num_hidden_layers, "moe_layers": num_layers,
        "experts_per_layer": adapter_for(config).spec.num_experts, "sequences": args.sequences,
        "tokens_per_sequence": args.tokens, "compared_tokens": reference_totals.tokens, "seed": args.seed,
        "reference": "transformers' own Experts modules with the bf16 expert weights; non-expert weights and "
                     f"activations in {str(compute_dtype(config, device)).removeprefix('torch.')}",
        "schemes": figures, "seconds": seconds,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"quality-synthetic-{args.preset}.json"
    write_json_atomic(out, result)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
