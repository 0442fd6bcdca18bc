"""How varied a synthetic model's routing is, layer by layer (mira bench --synthetic; issue #7).

Builds a synthetic preset (mira.bench.synthetic) on the CPU, with fewer layers or experts per layer
if asked so that its store fits in memory, runs one prompt of random ids through it with every
expert in place, and reports per MoE layer, over the prompt's last `--tokens` tokens:

- experts used: distinct experts routed to, against what independent uniform routing would use,
  E * (1 - (1 - K/E)^T);
- shared: the norm of the tokens' mean residual stream (the layer's input) over their mean norm:
  0 when tokens share nothing, 1 when every token carries the same vector;
- after previous: the share of a token's routed experts that the token before it also routed
  to, against K/E for independent uniform routing;
- gate speculation: the share of a token's routed experts at this layer that its router picks
  from the token's input two MoE layers before (mira.predict.baselines.RouterRule, as gate
  speculation applies it); none for the first two layers.

Prints a table and writes benchmarks/results/synthetic-routing-cpu.json (or --out), one entry per
preset and size, added to what the file holds.

    python benchmarks/synthetic_routing.py --preset qwen3-30b-a3b --experts 32
    python benchmarks/synthetic_routing.py --preset mixtral-8x7b --layers 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import result_header  # noqa: E402
from mira.bench.synthetic import PRESETS, preset_config, synthetic_skeleton, synthetic_store  # noqa: E402
from mira.predict.baselines import RouterRule, SpeculationWorkspace  # noqa: E402
from mira.runtime.engine import assemble  # noqa: E402
from mira.runtime.tracing import RoutingRecorder  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402

EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def measure(preset: str, layers: int | None, experts: int | None, prompt: int, tokens: int) -> dict:
    config = preset_config(preset)
    if layers:
        config.num_hidden_layers = layers
    if experts:
        for name in EXPERT_COUNT_FIELDS:
            if hasattr(config, name):
                setattr(config, name, experts)
    device = torch.device("cpu")
    model, sites, _ = synthetic_skeleton(config, device)
    store = synthetic_store(config, len(sites), "int8-shared", pin=False, progress=False, name=preset)
    mira_model = assemble(model, sites, store, None)
    inputs: dict[int, torch.Tensor] = {}
    for position, site in enumerate(sites):
        site.parent.register_forward_pre_hook(
            lambda module, args, position=position: inputs.__setitem__(position, args[0].detach().reshape(
                -1, args[0].shape[-1])))
    ids = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RoutingRecorder(mira_model) as recorder:
        mira_model(ids)
    routed = np.asarray(recorder.trace().topk_ids)[-tokens:]  # [T, L, K]
    E, K = store.num_experts, routed.shape[2]
    uniform = E * (1 - (1 - K / E) ** tokens)
    rows = []
    for position in range(len(sites)):
        x = inputs[position][-tokens:].float()  # [T, H]
        shared = (x.mean(0).norm() / x.norm(dim=1).mean()).item()
        rows.append({"layer": position, "experts_used": len(set(routed[:, position].reshape(-1).tolist())),
                     "shared": round(shared, 3),
                     "after_previous": round(_overlap(routed[1:, position], routed[:-1, position]), 3),
                     "gate_speculation": None})
    for position in range(2, len(sites)):
        rule = RouterRule(sites[position].parent.gate)
        with torch.no_grad():
            _, chosen = rule.route(inputs[position - 2][-tokens:], SpeculationWorkspace(rule, tokens, device))
        rows[position]["gate_speculation"] = round(_overlap(chosen.numpy(), routed[:, position]), 3)
    return {"preset": preset, "moe_layers": len(sites), "experts_per_layer": E, "top_k": K,
            "hidden": config.hidden_size, "model_type": config.model_type, "prompt_tokens": prompt,
            "tokens": tokens, "uniform_experts_used": round(uniform, 1), "uniform_after_previous": round(K / E, 3),
            "layers": rows}


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """The mean share of each row of `a` [T, K] found in the same row of `b` [T, K]."""
    return float(np.mean([len(set(x.tolist()) & set(y.tolist())) / len(x) for x, y in zip(a, b)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--experts", type=int, help="routed experts per layer (default: the preset's)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--tokens", type=int, default=48, help="last tokens measured (default 48)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "synthetic-routing-cpu.json")
    args = parser.parse_args()
    if args.tokens > args.prompt:
        sys.exit("--tokens must not exceed --prompt")
    figures = measure(args.preset, args.layers, args.experts, args.prompt, args.tokens)
    entry = {**result_header(" ".join(["python", "benchmarks/synthetic_routing.py", *sys.argv[1:]])), **figures}
    result = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    result["runs"] = [r for r in result["runs"] if r["command"] != entry["command"]] + [entry]
    write_json_atomic(args.out, result)
    print(f"{args.preset}: {figures['moe_layers']} MoE layers, {figures['experts_per_layer']} experts, top "
          f"{figures['top_k']}; {args.tokens} tokens would use {figures['uniform_experts_used']} experts per layer "
          f"if routed uniformly, and share {figures['uniform_after_previous']} of them with the token before")
    print(f"{'layer':>6} {'experts used':>13} {'shared':>7} {'after previous':>15} {'gate speculation':>17}")
    for row in figures["layers"]:
        gate = "" if row["gate_speculation"] is None else f"{row['gate_speculation']:.3f}"
        print(f"{row['layer']:>6} {row['experts_used']:>13} {row['shared']:>7.3f} {row['after_previous']:>15.3f} "
              f"{gate:>17}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
