"""Which INT4 variant the `int4` scheme uses: group size and symmetric or zero points (mira.store.int4).

For groups of 32, 64 and 128 weights, symmetric and with zero points, on the bundled model's experts,
and three diagnostic variants of 32-weight groups with zero points, none of them a store format:
"rotated" quantizes each matrix turned by a random-sign Hadamard transform along its input dimension
(spreading outliers over the group, as rotation-based schemes do) and turns the result back; "w13
only" and "w2 only" quantize one matrix and keep the other as the checkpoint has it (how much of the
loss each matrix carries):

- weight error: the relative squared error of the dequantized experts, sum over experts of
  ||W_q - W||^2 / sum of ||W||^2, for w13 and w2, and the bits each weight costs in the blob;
- end quality: the bundled model's held-out text scored with every variant's dequantized experts
  in transformers' own forward (float32, CPU), against the checkpoint's experts, by
  `mira.eval.ppl.measure` (the measurement of `mira eval ppl`): perplexity, KL, top-1 agreement.
  int8-shared is measured the same way, for scale.

    python benchmarks/int4_variants.py [--max-tokens N] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mira.bench.provenance import result_header  # noqa: E402
from mira.eval.data import HELDOUT_TEXT, read_documents, token_stream  # noqa: E402
from mira.eval.ppl import REFERENCE, measure, model_log_probs, windows  # noqa: E402
from mira.runtime.engine import BUNDLED_MODEL  # noqa: E402
from mira.store import int4  # noqa: E402
from mira.store.layout import ExpertLayout  # noqa: E402
from mira.store.quant import dequantize_expert, quantize_expert  # noqa: E402

GROUPS = (32, 64, 128)
DIAGNOSTIC = {"rotated": {"rotated": True}, "w13-only": {"only": "w13"}, "w2-only": {"only": "w2"}}


def variants() -> dict[str, dict]:
    """name -> int4 settings (group, zero_points; a diagnostic's rotated or only); None for int8-shared."""
    out = {f"int4-g{group}-{'zp' if zp else 'sym'}": {"group": group, "zero_points": zp}
           for group in GROUPS for zp in (False, True)}
    out |= {f"int4-g32-zp-{name}": {"group": 32, "zero_points": True} | extra for name, extra in DIAGNOSTIC.items()}
    return out | {"int8-shared": None}


def rotation(n: int, seed: int = 0) -> torch.Tensor:
    """A random-sign Hadamard matrix [n, n] (n a power of two), orthonormal, float32."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power of two, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1
    return (signs[:, None] * h / math.sqrt(n)).float()


def fake_quantized(w13: torch.Tensor, w2: torch.Tensor, settings: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's weights after a round trip through the variant's blob, float32."""
    if settings is None:
        layout = ExpertLayout("int8-shared", w13.shape[1], w2.shape[1])
        blob = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(quantize_expert(w13, w2, layout), blob)
        d13, d2 = dequantize_expert(layout.views(blob), layout)
        return d13.float(), d2.float()
    settings = dict(settings)
    rotated, only = settings.pop("rotated", False), settings.pop("only", None)
    r13, r2 = (rotation(w13.shape[1]), rotation(w2.shape[1])) if rotated else (None, None)
    d13, d2 = int4.dequantize(int4.quantize(w13 @ r13 if rotated else w13, w2 @ r2 if rotated else w2, **settings),
                              torch.float32)
    if rotated:
        d13, d2 = d13 @ r13.T, d2 @ r2.T
    return (d13 if only != "w2" else w13.float()), (d2 if only != "w13" else w2.float())


def bits_per_weight(hidden: int, intermediate: int, settings: dict | None) -> float | None:
    """What a weight costs in the variant's blob (None for a diagnostic that keeps a matrix as is)."""
    weights = 3 * hidden * intermediate
    if settings is None:
        return 8 * ExpertLayout("int8-shared", hidden, intermediate).nbytes / weights
    if "only" in settings:
        return None
    sections = int4.sections(hidden, intermediate, settings["group"])
    return 8 * sum(dtype.itemsize * torch.Size(shape).numel() for _, dtype, shape in sections) / weights


def fmt_bits(bits: float | None) -> str:
    return "-" if bits is None else f"{bits:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, help="score only the first N tokens of the held-out text")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int4-variants-tiny.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    experts = [layer.mlp.experts for layer in reference.model.layers]
    hidden, intermediate = experts[0].down_proj.shape[1], experts[0].down_proj.shape[2]
    models, weight_error = {REFERENCE: reference}, {}
    for name, settings in variants().items():
        start = time.perf_counter()
        model = copy.deepcopy(reference)
        sums = {"w13": [0.0, 0.0], "w2": [0.0, 0.0]}  # squared error, squared norm
        for source, target in zip(experts, (layer.mlp.experts for layer in model.model.layers)):
            for e in range(source.gate_up_proj.shape[0]):
                w13, w2 = source.gate_up_proj[e].detach(), source.down_proj[e].detach()  # [2I, H], [H, I]
                d13, d2 = fake_quantized(w13, w2, settings)
                for key, w, d in (("w13", w13, d13), ("w2", w2, d2)):
                    sums[key][0] += float((d.double() - w.double()).square().sum())
                    sums[key][1] += float(w.double().square().sum())
                with torch.no_grad():
                    target.gate_up_proj[e].copy_(d13)
                    target.down_proj[e].copy_(d2)
        models[name] = model.eval()
        total = sum(s[0] for s in sums.values()) / sum(s[1] for s in sums.values())
        weight_error[name] = {"relative_squared_error": total,
                              **{f"relative_squared_error_{k}": s[0] / s[1] for k, s in sums.items()},
                              "bits_per_weight": bits_per_weight(hidden, intermediate, settings),
                              "settings": settings}
        print(f"{name}: weight error {total:.5f}, {fmt_bits(weight_error[name]['bits_per_weight'])} bits/weight "
              f"({time.perf_counter() - start:.1f} s)", flush=True)

    ids = token_stream(AutoTokenizer.from_pretrained(BUNDLED_MODEL), read_documents(HELDOUT_TEXT), args.max_tokens)
    spans = windows(len(ids), args.context, args.context // 2)
    figures = measure({name: model_log_probs(model) for name, model in models.items()}, ids, spans, progress=False)
    result = result_header("python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]), "cpu") | {
        "model": str(BUNDLED_MODEL), "data": str(HELDOUT_TEXT), "tokens": len(ids), "context": args.context,
        "stride": args.context // 2, "windows": len(spans), "dtype": "float32",
        "how": "dequantized experts in transformers' forward, scored against the checkpoint's experts",
        "variants": {name: weight_error[name] | figures[name] for name in weight_error},
        "reference": figures[REFERENCE],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':>20} {'bits/w':>7} {'w err':>8} {'ppl':>8} {'change':>8} {'KL':>8} {'top-1':>7}")
    for name, f in result["variants"].items():
        print(f"{name:>20} {fmt_bits(f['bits_per_weight']):>7} {f['relative_squared_error']:8.5f} "
              f"{f['perplexity']:8.4f} "
              f"{100 * f['perplexity_change']:+7.2f}% {f['mean_kl']:8.5f} {100 * f['top1_agreement']:6.2f}%")


if __name__ == "__main__":
    main()
