"""Reference quantization of expert weights (paper IV-B, DESIGN.md 2.4).

`int8-shared` is Mira's scheme: symmetric INT8 with ONE bf16 scale vector per expert, of length H,
shared by the three matrices. W1 and W3 ([I, H]) are scaled per input channel and W2 ([H, I]) per
output channel, so dequantization folds into the activations:

    W13q diag(s) x = W13q (s * x)        y = s * (W2q h)

and a kernel converts INT8 to the compute dtype with no per-weight multiply. `int8-row` is the usual
per-output-row scheme (one scale per row of each matrix). `none` keeps the checkpoint's dtype.

Scales are rounded UP to bf16, so |w| <= 127 * scale still holds after rounding: no weight is
clipped and every dequantized weight lies within half a quantization step (scale / 2) of the
original. Quantization runs in float64, a few rows at a time, so that bound is exact.

H hidden, I expert intermediate.
"""

from __future__ import annotations

import torch

from mira.store import int4
from mira.store.layout import ExpertLayout

QMAX = 127
ROWS = 256  # rows quantized at a time


def quantize_expert(w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize one expert.

    Args:
        w13: [2I, H] gate rows then up rows ([I, H] up rows for ungated experts).
        w2: [H, I] down projection.
        layout: the target blob layout (its scheme decides the quantization).
        b13, b2: the biases [2I] and [H], kept in float32, for a layout with biases.

    Returns:
        The tensors to pack, keyed by section name.
    """
    tensors = _quantize_weights(w13, w2, layout)
    if layout.bias:
        tensors.update(b13=b13.float(), b2=b2.float())
    return tensors


def _quantize_weights(w13: torch.Tensor, w2: torch.Tensor, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    if layout.scheme == "none":
        return {"w13": w13.to(layout.weight_dtype), "w2": w2.to(layout.weight_dtype)}
    if layout.scheme == "int4":  # group-wise 4-bit: mira.store.int4
        return int4.quantize(w13, w2)
    if layout.scheme == "int8-shared":
        amax = torch.maximum(w13.abs().amax(dim=0), w2.abs().amax(dim=1)).double()  # [H]
        scale = _scale_from_amax(amax)
        return {"w13": _quantize(w13, scale[None, :]), "w2": _quantize(w2, scale[:, None]), "scale": scale}
    scale13 = _scale_from_amax(w13.abs().amax(dim=1).double())  # [2I]
    scale2 = _scale_from_amax(w2.abs().amax(dim=1).double())  # [H]
    return {"w13": _quantize(w13, scale13[:, None]), "w2": _quantize(w2, scale2[:, None]),
            "scale13": scale13, "scale2": scale2}


def dequantize_expert(views: dict[str, torch.Tensor], layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 weights ([2I, H], [H, I]) from the typed views of one blob (for tests and analysis)."""
    if layout.scheme == "int4":
        return int4.dequantize(views, torch.float64)
    w13, w2 = views["w13"].double(), views["w2"].double()
    if layout.scheme == "int8-shared":
        scale = views["scale"].double()
        return w13 * scale[None, :], w2 * scale[:, None]
    if layout.scheme == "int8-row":
        return w13 * views["scale13"].double()[:, None], w2 * views["scale2"].double()[:, None]
    return w13, w2


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """bf16 scales >= amax / 127, rounded up; an all-zero channel gets scale 1 (its weights quantize to 0)."""
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax)).float()
    bits = scale.view(torch.int32).to(torch.int64)
    rounded_up = ((bits + 0xFFFF) >> 16) << 16  # positive floats: clearing the low half rounds toward zero
    return rounded_up.to(torch.int32).view(torch.float32).to(torch.bfloat16)


def _quantize(weights: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(weights / scale) as int8, in float64, ROWS rows at a time (bounded temporary memory)."""
    out = torch.empty(weights.shape, dtype=torch.int8)
    for start in range(0, weights.shape[0], ROWS):
        rows = slice(start, start + ROWS)
        row_scale = scale[rows] if scale.shape[0] > 1 else scale  # [rows, 1] per row, or [1, cols] shared
        out[rows] = (weights[rows].double() / row_scale.double()).round_().clamp_(-QMAX, QMAX)
    return out
