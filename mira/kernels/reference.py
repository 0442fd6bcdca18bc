"""The expert FFN computed from quantized blobs in plain PyTorch (paper IV-F, DESIGN.md 2.8).

Every layout the experts interface declares is computed here: biases, ungated experts, and a
family's own gating (gpt-oss's clamped SwiGLU) passed in as `gate`.

This is the CPU path and the ground truth every fused kernel is tested against. The kernel sees
only blobs: `blobs[e]` is expert e's uint8 blob (a row of the slot buffer, or the expert's row in
the pinned store), or None when expert e is not routed in this call. It never knows about the cache.

T tokens, E experts in the layer, K routed per token, H hidden, I expert intermediate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mira.store import int4
from mira.store.layout import ExpertLayout


def expert_ffn(x: torch.Tensor, views: dict[str, torch.Tensor], layout: ExpertLayout, act: Callable | None,
               gate: Callable | None = None, units: tuple[int, int] | None = None) -> torch.Tensor:
    """One expert's FFN on x [T, H] -> [T, H], dequantization folded into the activations.

    The hidden state is act(gate rows) * up rows (SwiGLU with SiLU), or `gate` applied to the
    gate-and-up output [T, 2I] when the family has its own gating, or act(up) for ungated
    experts; biases, when the layout has them, follow each projection.

    `units` (start, stop) keeps only those intermediate units of the hidden state: the part of the
    output one executor computes when an expert is cut between two (the part from unit 0 adds
    the down bias). The parts of a cut add up to the whole expert.
    """
    dtype = x.dtype
    if layout.scheme == "int4":  # dequantized group by group (mira.store.int4)
        w13, w2 = int4.dequantize(views, dtype)
    else:
        w13, w2 = views["w13"].to(dtype), views["w2"].to(dtype)
    if layout.scheme == "int8-shared":
        scale = views["scale"].to(dtype)
        gate_up = (x * scale) @ w13.T  # [T, 2I]
    elif layout.scheme == "int8-row":
        gate_up = (x @ w13.T) * views["scale13"].to(dtype)
    else:
        gate_up = x @ w13.T
    if layout.bias:
        gate_up = gate_up + views["b13"].to(dtype)
    if gate is not None:
        h = gate(gate_up)  # [T, I]
    elif layout.gated:
        g, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        h = act(g) * up
    else:
        h = act(gate_up)  # [T, I]: up rows only
    if units is not None:
        start, stop = units
        kept = torch.zeros(layout.intermediate, dtype=torch.bool, device=h.device)
        kept[start:stop] = True
        h = h * kept
    y = h @ w2.T  # [T, H]
    if layout.scheme == "int8-shared":
        y = y * scale
    elif layout.scheme == "int8-row":
        y = y * views["scale2"].to(dtype)
    if layout.bias and (units is None or units[0] == 0):
        y = y + views["b2"].to(dtype)
    return y


def moe_ffn_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    blobs: Sequence[torch.Tensor | None],
    layout: ExpertLayout,
    act: Callable | None,
    gate: Callable | None = None,
    absent: str = "raise",
    limits: Sequence[int] | None = None,
) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs, like transformers' Experts.forward.

    Args:
        hidden: [T, H] token states.
        top_k_index: [T, K] routed expert ids.
        top_k_weights: [T, K] routing weights.
        blobs: length E; the blob of every routed expert (others may be None).
        layout: the blob layout of this store.
        act: the activation applied to the gate projection (to the up projection when ungated).
        gate: the family's own gating of the gate-and-up output [T, 2I] -> [T, I] (in place of act).
        absent: a routed expert without a blob "raise"s, or adds "zero" (another executor computes it).
        limits: length E; expert e computes only its intermediate units [0, limits[e]) (the rest of a
            cut expert is computed elsewhere); None: every unit.

    Returns:
        [T, H] in hidden's dtype.
    """
    out = torch.zeros_like(hidden)
    for expert in top_k_index.unique().tolist():  # ascending, as transformers adds them
        blob = blobs[expert]
        if blob is None and absent == "zero":
            continue
        if blob is None:
            raise ValueError(f"expert {expert} is routed but no blob was given for it")
        token_idx, k_pos = torch.where(top_k_index == expert)
        units = None if limits is None or limits[expert] >= layout.intermediate else (0, limits[expert])
        y = expert_ffn(hidden[token_idx], layout.views(blob), layout, act, gate, units)  # [T_e, H]
        y = y * top_k_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
