"""Where the top-1 disagreements between int8 experts and the unquantized model come from, on a
Mixtral-family checkpoint (default: the bundled model) over the text `mira eval ppl` scores.

Every variant is transformers' own model with one thing changed, compared token by token with the
unchanged float32 model over the same windows (mira.eval.ppl): the experts replaced by the store's
int8 dequantization (mira.store.quant); the same with each MoE layer's expert choice replayed from
the reference forward (routing frozen), which separates routing flips from the experts' own error;
int8-shared with each scale chosen to minimise its channel's squared error instead of max-abs;
the shared-scale scheme at 10 and 12 bits; and the unquantized model run in bf16. Agreement is
also split by the reference's margin between its two best tokens.

    python benchmarks/quality_agreement.py                                   # the bundled model, CPU
    python benchmarks/quality_agreement.py --max-tokens 4096 --out /tmp/a.json   # a quick look

T scored tokens, V vocabulary, K routed per token, E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import result_header  # noqa: E402
from mira.eval.data import HELDOUT_TEXT, read_documents, token_stream  # noqa: E402
from mira.eval.ppl import SchemeTotals, model_log_probs, windows  # noqa: E402
from mira.runtime.engine import BUNDLED_MODEL  # noqa: E402
from mira.store.files import write_json_atomic  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.store.quant import QMAX, _scale_from_amax, dequantize_expert, quantize_expert  # noqa: E402

MARGIN_EDGES = (0.0, 0.01, 0.05, 0.1, 0.5, float("inf"))  # nats between the reference's two best tokens
ExpertMap = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # w13, w2 -> float64 pair


class RouteLog:
    """The expert choice [T, K] of every MoE layer in the reference's latest forward."""

    def __init__(self):
        self.choices: dict[int, torch.Tensor] = {}


class ReplayRouter(nn.Module):
    """Wraps a Mixtral router (softmax over E, top K, renormalised). On the reference it records the
    choice; elsewhere it counts choices that differ from the reference's and, when `frozen`, routes
    to the reference's experts with this model's own weights for them."""

    def __init__(self, router: nn.Module, layer: int, log: RouteLog, role: str):
        super().__init__()
        self.router, self.layer, self.log, self.role = router, layer, log, role
        self.flips = self.decisions = 0

    def forward(self, hidden_states: torch.Tensor):
        logits, weights, chosen = self.router(hidden_states)  # [T, E], [T, K], [T, K]
        if self.role == "record":
            self.log.choices[self.layer] = chosen
            return logits, weights, chosen
        reference = self.log.choices[self.layer]
        self.flips += int((chosen.sort(dim=1).values != reference.sort(dim=1).values).any(dim=1).sum())
        self.decisions += chosen.shape[0]
        if self.role != "frozen":
            return logits, weights, chosen
        probs = torch.softmax(logits.float(), dim=-1).gather(1, reference)  # [T, K]
        return logits, (probs / probs.sum(dim=1, keepdim=True)).to(weights.dtype), reference


@dataclass
class Tally:
    """One variant's figures: SchemeTotals, top-1 agreement per reference-margin band, and routing."""

    totals: SchemeTotals = field(default_factory=SchemeTotals)
    band_tokens: list[int] = field(default_factory=lambda: [0] * (len(MARGIN_EDGES) - 1))
    band_agree: list[int] = field(default_factory=lambda: [0] * (len(MARGIN_EDGES) - 1))

    def add(self, log_probs: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor) -> None:
        """log_probs and reference [T, V], targets [T]."""
        self.totals.add(log_probs, targets, reference)
        best_two = reference.topk(2, dim=1).values  # [T, 2]
        margin = best_two[:, 0] - best_two[:, 1]
        agree = log_probs.argmax(dim=1) == reference.argmax(dim=1)
        for band, (low, high) in enumerate(zip(MARGIN_EDGES, MARGIN_EDGES[1:])):
            inside = (margin >= low) & (margin < high)
            self.band_tokens[band] += int(inside.sum())
            self.band_agree[band] += int((agree & inside).sum())

    def bands(self) -> list[dict]:
        return [{"margin_nats": [low, high if high != float("inf") else None], "tokens": count,
                 "top1_agreement": agree / count if count else None}
                for low, high, count, agree in zip(MARGIN_EDGES, MARGIN_EDGES[1:], self.band_tokens, self.band_agree)]


def store_scheme(scheme: str) -> ExpertMap:
    """The store's own quantization of one expert, dequantized in float64."""
    def apply(w13: torch.Tensor, w2: torch.Tensor):
        layout = ExpertLayout(scheme, w13.shape[1], w2.shape[1])
        return dequantize_expert(quantize_expert(w13, w2, layout), layout)
    return apply


def shared_at(qmax: int) -> ExpertMap:
    """The int8-shared scheme (one scale per hidden channel of w13's columns and w2's rows) at
    integers in [-qmax, qmax], max-abs float64 scales."""
    def apply(w13: torch.Tensor, w2: torch.Tensor):
        w13, w2 = w13.double(), w2.double()
        scale = torch.maximum(w13.abs().amax(dim=0), w2.abs().amax(dim=1)).clamp_min(1e-30) / qmax  # [H]
        return (_round(w13.T, scale, qmax).T, _round(w2, scale, qmax))
    return apply


def _round(rows: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """rows [C, n] rounded to multiples of scale [C] within +-qmax steps, float64."""
    return (rows / scale[:, None]).round().clamp(-qmax, qmax) * scale[:, None]


def squared_error(rows: list[torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """Per channel c, the float64 squared error of rounding every rows[j][c] to int8 steps of scale[c]."""
    return sum(((_round(group, scale, QMAX) - group) ** 2).sum(dim=1) for group in rows)


def clipped_scales(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per channel, the bf16 scale between half the max-abs scale and the max-abs scale (every bf16
    value there is tried) whose int8 rounding of the channel's weights has the least squared error;
    max-abs itself is a candidate, so no channel loses. rows: float64 [C, n_j] groups sharing scales."""
    amax = torch.stack([group.abs().amax(dim=1) for group in rows]).amax(dim=0)  # [C]
    top = _scale_from_amax(amax)  # bf16, the store's max-abs scale
    best, best_error = top, squared_error(rows, top.double())
    candidate = top
    while True:
        candidate = (candidate.view(torch.int16) - 1).view(torch.bfloat16)  # the next bf16 value down
        usable = candidate.double() >= top.double() / 2
        if not usable.any():
            return best
        error = torch.where(usable, squared_error(rows, candidate.double()), best_error)
        better = error < best_error
        best, best_error = torch.where(better, candidate, best), torch.where(better, error, best_error)


def shared_clipped(w13: torch.Tensor, w2: torch.Tensor):
    """int8-shared with clipped_scales instead of max-abs."""
    w13, w2 = w13.double(), w2.double()
    scale = clipped_scales([w13.T, w2]).double()  # [H]
    return _round(w13.T, scale, QMAX).T, _round(w2, scale, QMAX)


def with_experts(model: nn.Module, expert_map: ExpertMap) -> tuple[nn.Module, float]:
    """A copy of `model` whose experts are expert_map of its own, and the relative squared weight error."""
    variant, error, energy = copy.deepcopy(model), 0.0, 0.0
    with torch.no_grad():
        for layer in variant.model.layers:
            experts = layer.mlp.experts
            for expert in range(experts.gate_up_proj.shape[0]):  # [E, 2I, H] and [E, H, I]
                w13, w2 = experts.gate_up_proj[expert], experts.down_proj[expert]
                new13, new2 = expert_map(w13, w2)
                error += float(((new13 - w13.double()) ** 2).sum() + ((new2 - w2.double()) ** 2).sum())
                energy += float((w13.double() ** 2).sum() + (w2.double() ** 2).sum())
                w13.copy_(new13)
                w2.copy_(new2)
    return variant, error / energy


def wrap_routers(model: nn.Module, log: RouteLog, role: str) -> list[ReplayRouter]:
    routers = []
    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate = ReplayRouter(layer.mlp.gate, index, log, role)
        routers.append(layer.mlp.gate)
    return routers


def _shown(path: Path) -> str:
    """`path` relative to the repository when inside it (the same on every machine), else as given."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="a Mixtral-family model directory")
    parser.add_argument("--data", type=Path, default=HELDOUT_TEXT, help=".txt or .jsonl (default: held-out text)")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "agreement-tiny.json")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()

    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if reference.config.model_type != "mixtral":
        raise SystemExit(f"{args.model} is a {reference.config.model_type} model; this script wraps Mixtral routers")
    ids = token_stream(AutoTokenizer.from_pretrained(args.model), read_documents(args.data), args.max_tokens)
    stride = args.stride or args.context // 2
    spans = windows(len(ids), args.context, stride)

    weight_variants = {"int8-shared": store_scheme("int8-shared"), "int8-row": store_scheme("int8-row"),
                       "int8-shared, scales by least squared error": shared_clipped,
                       "10-bit shared scale": shared_at(511), "12-bit shared scale": shared_at(2047)}
    models, weight_error = {}, {}
    for name, expert_map in weight_variants.items():
        models[name], weight_error[name] = with_experts(reference, expert_map)
    for scheme in ("int8-shared", "int8-row"):
        models[f"{scheme}, routing frozen"] = copy.deepcopy(models[scheme])
    models["none in bf16"] = copy.deepcopy(reference).to(torch.bfloat16)
    log, routers = RouteLog(), {}
    wrap_routers(reference, log, "record")
    for name, model in models.items():
        routers[name] = wrap_routers(model, log, "frozen" if name.endswith("routing frozen") else "compare")

    reference_forward = model_log_probs(reference)
    forwards = {name: model_log_probs(model) for name, model in models.items()}
    reference_totals, tallies = SchemeTotals(), {name: Tally() for name in models}
    for window in tqdm(spans, desc="windows", disable=args.quiet):
        inputs, targets = ids[window.begin:window.end], ids[window.first_scored:window.end]
        scored = slice(window.first_scored - window.begin - 1, window.end - window.begin - 1)
        expected = reference_forward(inputs)[scored]  # [T, V]
        reference_totals.add(expected, targets, expected)
        for name, forward in forwards.items():
            tallies[name].add(forward(inputs)[scored], targets, expected)

    variants = {}
    for name, tally in tallies.items():
        flips = sum(router.flips for router in routers[name])
        decisions = sum(router.decisions for router in routers[name])
        variants[name] = tally.totals.summary(reference_totals) | {
            "relative_weight_error": weight_error.get(name.removesuffix(", routing frozen")),
            "routing_changes": flips / decisions, "by_reference_margin": tally.bands()}
        print(f"{name}: top-1 {100 * variants[name]['top1_agreement']:.2f}%, mean KL {variants[name]['mean_kl']:.5f}, "
              f"routing changes {100 * flips / decisions:.2f}%", file=sys.stderr)
    result = result_header("python " + shlex.join(["benchmarks/quality_agreement.py", *sys.argv[1:]]), "cpu") | {
        "model": _shown(args.model), "data": _shown(args.data), "tokens": len(ids), "scored_tokens": reference_totals.tokens,
        "context": args.context, "stride": stride, "windows": len(spans),
        "reference": "transformers' own model, float32, the checkpoint's expert weights",
        "reference_perplexity": reference_totals.perplexity,
        "notes": {"relative_weight_error": "sum of squared expert weight errors over the sum of squared weights",
                  "routing_changes": "share of (token, MoE layer) whose chosen expert set differs from the "
                                     "reference's; for a frozen variant, the choices it would have made",
                  "by_reference_margin": "top-1 agreement of the tokens whose reference top-2 log-probability "
                                         "margin lies in the band"},
        "variants": variants,
    }
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
