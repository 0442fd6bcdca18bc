"""Missed experts computed on the CPU, straight from their blobs in the host store (DESIGN.md 2.8).

The CPU reads the same blob the GPU would copy over PCIe: the weights are typed views into it
(`ExpertLayout.views`), never a second copy. INT8 products go through torch's weight-only INT8
matmul, `torch._weight_int8pack_mm(x [T, K], w int8 [N, K], scale [N]) = x @ (scale * w)^T`, which
converts the weights in registers and accumulates in fp32. On the CPU it takes activations and
scales of one dtype (bf16, fp16 or fp32) and a contiguous weight; its fp32 form runs far slower than
the bf16 one (measured on an AVX-512 CPU), so activations enter as bf16 whatever the caller's dtype,
and results leave in the caller's dtype. The vectorised bf16 form walks the reduction 16 elements at
a time with aligned loads of the activations: for a reduction length that is not a multiple of 16 it
reads past the row (wrong results, or a crash), and activations that do not start on a 32-byte
boundary crash it. So products over such a length take the fp32 form (the same roundings: inputs and
outputs still pass through bf16), chosen by the reduction length, and activations are copied to a
fresh, aligned tensor when they are not aligned.

A cut expert's CPU part (intermediate units [first, I)) needs only its columns of W2 [H, I], which
are strided. Copied into a buffer the executor keeps and multiplied there, they cost about three
reads of their bytes (`COLUMN_COPY_COST`: the copy reads and writes them, the gate and up products
before it have evicted the buffer from the caches, and the product reads them again), so below a
third of the units it takes that way, and above it multiplies the whole W2 against a hidden state
that is zero below `first`. Float weights take the strided columns as they are.

The weight-only products read every weight again for each token, so their time grows with the
tokens as if each were alone. A whole INT8 expert of DENSE_TOKENS tokens or more (a prefill's) is
therefore converted to bf16 once, into two buffers the executor keeps (two bytes a weight of one
expert), and multiplied densely, reading each weight once for all its tokens
(benchmarks/cpu_dense.py measures where that starts to pay). INT4 experts stay with their
weight-only products: dequantizing one whole costs the CPU about as much as those products for a
few hundred tokens.

The two INT8 schemes map onto it as follows (DESIGN.md 2.4):

- `int8-row`: per output row of each matrix, exactly the matmul's own scale argument.
- `int8-shared`: ONE vector s [H]. W13 [2I, H] is scaled per input channel, W13 = W13q diag(s), so
  W13 x = W13q (s * x): s is folded into the activations and the gate/up product takes unit scales;
  W2 [H, I] is scaled per output channel, W2 = diag(s) W2q, so W2 h = s * (W2q h): s is the
  down product's per-row scale.

`int4` goes through torch's INT4 weight-only matmul, which reads the blob's tiled codes as they are
on an AVX-512 CPU (mira.kernels.cpu_int4, with its fallback elsewhere). `none` multiplies in the
weights' own dtype (views, no conversion of the weights).

Every layout the experts interface declares is served, as mira.kernels.reference.expert_ffn
computes it: biases (float32 sections, added in float32 after each product), ungated experts
(act(up)) and a family's own gating (`gate`, applied to the gate-and-up output [T, 2I]).

T tokens, E experts in the layer, K routed per token, H hidden, I expert intermediate, I' the
intermediate units a cut expert's part computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mira.kernels.cpu_int4 import Int4Matmul
from mira.store.layout import ExpertLayout

COMPUTE_DTYPE = torch.bfloat16  # activations of the INT8 products (see the module docstring)
VECTOR = 16  # reduction elements per step of the vectorised bf16 product
ACT_ALIGN = 32  # bytes; the vectorised bf16 product loads activation rows aligned to this
COLUMN_COPY_COST = 3.0  # a cut's INT8 columns of W2, copied then multiplied, in reads of their bytes
DENSE_TOKENS = 32  # an INT8 expert's tokens from which it is converted to bf16 for dense products


def default_column_cost(scheme: str) -> float:
    """What a cut's CPU part pays for its columns of the down matrix, in reads of their bytes: float
    weights are multiplied strided as they are; INT8 ones copied first."""
    return 1.0 if scheme == "none" else COLUMN_COPY_COST


class CpuExpertFFN:
    """The expert FFN of one store layout on the CPU, reading blobs in place.

    Args:
        layout: the blob layout of the store.
        act: the activation applied to the gate projection (to the up projection when ungated).
        gate: the family's own gating of the gate-and-up output [T, 2I] -> [T, I] (in place of act).
        column_cost: what a cut's columns of W2 cost, in reads of their bytes (`reads_columns`);
            None: the scheme's (`default_column_cost`); math.inf: the whole W2 always (an A/B).
        torch_codes: int4 blobs hold their codes in the layout of this CPU's torch INT4 matmul
            (mira.kernels.cpu_int4.adapt_codes); else in the store's tiles.
    """

    def __init__(self, layout: ExpertLayout, act: Callable, gate: Callable | None = None,
                 column_cost: float | None = None, torch_codes: bool = False) -> None:
        self.layout = layout
        self.act = act
        self.gate = gate
        self.column_cost = default_column_cost(layout.scheme) if column_cost is None else column_cost
        rows13 = layout.sections["w13"].shape[0]  # 2I, or I when ungated
        # int8-shared folds its scale into the gate/up activations: the product itself takes unit scales
        self._unit = torch.ones(rows13, dtype=COMPUTE_DTYPE) if layout.scheme == "int8-shared" else None
        self._gate_up_mm = _int8_product(layout.hidden)
        self._int4_mm = Int4Matmul(fast=True if torch_codes else None) if layout.scheme == "int4" else None
        self._columns = torch.empty(0, dtype=torch.int8)  # a cut's columns of W2, copied (`_down_operands`)
        self._column_views: dict[torch.Size, torch.Tensor] = {}  # views of that buffer by shape, made once
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # a blob's address -> its views
        self._dense_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # W13, W2 in bf16 (`_dense`)

    def expert(self, x: torch.Tensor, views: dict[str, torch.Tensor], first: int = 0) -> torch.Tensor:
        """One expert's FFN on x [T, H] -> [T, H] in x's dtype, from the typed views of its blob.

        From `first` > 0 on, only the intermediate units [first, I): the CPU's part of an expert cut
        between it and the device, which computes the units below `first` and adds the down bias.
        Gate and up take their rows of the cut; down its columns or its whole matrix (`reads_columns`).
        Calls with a cut share one buffer: one thread at a time.
        """
        scheme = self.layout.scheme
        ranges = self._w13_ranges(first)  # the rows of w13 the cut computes (None: all)
        w13 = _rows(views["w13"], ranges)  # products of these: gate_up, [T, 2I] whole or a cut's [T, I'] parts
        if not first and x.shape[0] >= DENSE_TOKENS and scheme in ("int8-shared", "int8-row"):
            y = self._dense(x, views)
        elif scheme == "none":
            dtype = views["w13"].dtype
            gate_up = [F.linear(x.to(dtype), w) for w in w13]
            h, w2 = self._down_operands(self._hidden(gate_up, views, ranges), views["w2"], first)
            y = F.linear(h.to(dtype), w2)  # [T, H]
        elif scheme == "int4":  # whole experts only: the INT4 kernels cut none (no cut granule)
            if first:
                raise ValueError("int4 experts are computed whole; the device cuts none")
            gate_up = [self._int4_mm(x, views["w13"], views["sz13"])]
            y = self._int4_mm(self._hidden(gate_up, views, None), views["w2"], views["sz2"])  # [T, H] float32
        elif scheme == "int8-shared":
            scale = views["scale"]  # [H] bf16
            xs = _as(x, COMPUTE_DTYPE) * scale
            gate_up = [self._gate_up_mm(xs, w, unit) for w, unit in zip(w13, _rows(self._unit, ranges))]
            h, w2 = self._down_operands(self._hidden(gate_up, views, ranges), views["w2"], first)
            y = _int8_product(w2.shape[1])(h.to(COMPUTE_DTYPE), w2, scale)
        else:
            xb = _as(x, COMPUTE_DTYPE)
            gate_up = [self._gate_up_mm(xb, w, s) for w, s in zip(w13, _rows(views["scale13"], ranges))]
            h, w2 = self._down_operands(self._hidden(gate_up, views, ranges), views["w2"], first)
            y = _int8_product(w2.shape[1])(h.to(COMPUTE_DTYPE), w2, views["scale2"])
        if self.layout.bias and first == 0:
            y = y.float() + views["b2"]
        return _as(y, x.dtype)

    def _dense(self, x: torch.Tensor, views: dict[str, torch.Tensor]) -> torch.Tensor:
        """A whole INT8 expert on x [T, H] of DENSE_TOKENS or more: its codes converted to bf16 once
        (every INT8 value is a bf16), into buffers kept for the next such call, then dense products,
        which use each weight for all T tokens where the weight-only ones read it again per token."""
        if self._dense_buffers is None:
            rows13, H, I = views["w13"].shape[0], self.layout.hidden, self.layout.intermediate
            self._dense_buffers = (torch.empty(rows13, H, dtype=COMPUTE_DTYPE), torch.empty(H, I, dtype=COMPUTE_DTYPE))
        w13, w2 = (buffer.copy_(views[name]) for buffer, name in zip(self._dense_buffers, ("w13", "w2")))
        xb = _as(x, COMPUTE_DTYPE)
        if self.layout.scheme == "int8-shared":  # W13 x = W13q (s * x), W2 h = s * (W2q h)
            scale = views["scale"]
            h = self._hidden([F.linear(xb * scale, w13)], views, None)
            return F.linear(h.to(COMPUTE_DTYPE), w2) * scale
        h = self._hidden([F.linear(xb, w13) * views["scale13"]], views, None)
        return F.linear(h.to(COMPUTE_DTYPE), w2) * views["scale2"]

    def __call__(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        blobs: Sequence[torch.Tensor | None],
        experts: Sequence[int],
        *,
        out: torch.Tensor | None = None,
        cut: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The weighted sum of the outputs of `experts` only (a subset of the routed ones; the GPU
        computes the rest and the two partial sums add up to the layer's output).

        Args:
            hidden: [T, H] token states on the CPU.
            top_k_index: [T, K] routed expert ids.
            top_k_weights: [T, K] routing weights.
            blobs: length E; the host blob of every expert in `experts` (others may be None).
            experts: the experts to compute here; one routed to no token contributes nothing.
            out: [T, H] written in full (rows no expert here serves get zeros); allocated when None.
            cut: (expert, first): that expert of `experts` contributes only its intermediate units
                from `first` on (`expert`); None: every expert whole.

        Returns:
            [T, H] in out's dtype (hidden's when out is None), summed in fp32.

        Raises:
            ValueError: an expert in `experts` has no blob.
        """
        for expert in experts:
            if blobs[expert] is None:
                raise ValueError(f"expert {expert} is to be computed on the CPU but no blob was given for it")
        firsts = dict([cut]) if cut is not None else {}
        if hidden.shape[0] == 1:  # a float32 out is summed into in place (one torch call fewer)
            into = out if out is not None and out.dtype == torch.float32 else None
            total = self._one_token(hidden, top_k_index, top_k_weights, blobs, experts, firsts, into)
        else:
            total = torch.zeros(hidden.shape, dtype=torch.float32)  # [T, H]
            for expert in experts:
                token_idx, k_pos = torch.where(top_k_index == expert)  # [T_e] each
                if token_idx.numel() == 0:
                    continue
                y = self.expert(hidden[token_idx], self.views(blobs[expert]), firsts.get(expert, 0))  # [T_e, H]
                total.index_add_(0, token_idx, y.float() * top_k_weights[token_idx, k_pos, None].float())
        if out is None:
            return total.to(hidden.dtype)
        return total if total is out else out.copy_(total)

    def _one_token(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   blobs: Sequence[torch.Tensor | None], experts: Sequence[int], firsts: dict[int, int],
                   total: torch.Tensor | None = None) -> torch.Tensor:
        """A decode call's sum [1, H] in float32 (into `total` when given) with half the torch
        operations: the routing read once, no gathers, one accumulation per expert (a worker thread
        gives the GIL up at each operation)."""
        route, weights = top_k_index.tolist()[0], top_k_weights.tolist()[0]  # [K] each
        total = torch.zeros(hidden.shape, dtype=torch.float32) if total is None else total.zero_()  # [1, H]
        for expert in experts:
            if expert in route:
                y = self.expert(hidden, self.views(blobs[expert]), firsts.get(expert, 0))  # [1, H]
                total.add_(y, alpha=weights[route.index(expert)])
        return total

    def views(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """The typed views of a blob, made once per address: their slicing is a dozen operations, each
        of which a worker thread must take the GIL back after. Keyed by address, not by tensor, as a
        slot's row or a store's blob is a new tensor each time it is read; the views kept hold the
        memory, so no other blob can come to lie at that address."""
        views = self._views.get(blob.data_ptr())
        if views is None:
            views = self._views[blob.data_ptr()] = self.layout.views(blob)
        return views

    def _w13_ranges(self, first: int) -> list[tuple[int, int]] | None:
        """The rows of w13 that intermediate units [first, I) read: None (all of them, unsliced) when
        `first` is 0, else the cut's gate rows and its up rows."""
        I = self.layout.intermediate
        if not 0 <= first < I:
            raise ValueError(f"a cut expert's CPU part starts at an intermediate unit in [0, {I}), not {first}")
        if first == 0:
            return None
        return [(first, I), (I + first, 2 * I)] if self.layout.gated else [(first, I)]

    def _hidden(self, gate_up: list[torch.Tensor], views: dict[str, torch.Tensor],
                ranges: list[tuple[int, int]] | None) -> torch.Tensor:
        """The hidden state [T, I'] in float32 from the gate-and-up output of the w13 rows in `ranges`,
        given as the products of those ranges ([T, 2I'] whole, or a cut's gate part and up part,
        [T, I'] each): its bias added, then the family's gate, act(gate) * up, or act(up). Without a
        bias or a family's gate the parts are taken as they come (no join, no split: each torch call
        lets a worker's GIL go) and only the gate is converted, the product promoting up to float32."""
        if self.layout.bias or self.gate is not None:
            joined = _joined(gate_up).float()
            if self.layout.bias:
                joined = joined + _joined(_rows(views["b13"], ranges))
            if self.gate is not None:
                return self.gate(joined)
            gate_up = [joined]
        if not self.layout.gated:
            return self.act(gate_up[0].float())
        gate, up = gate_up if len(gate_up) == 2 else gate_up[0].chunk(2, dim=-1)  # [T, I'] each
        return self.act(gate.float()) * up

    def reads_columns(self, share: float) -> bool:
        """Whether a cut's CPU part with `share` of the intermediate units reads only its columns of
        the down matrix (else the whole matrix): where they cost less than the whole."""
        return self.column_cost * share < 1

    def _down_operands(self, h: torch.Tensor, w2: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The down product's operands for the units [first, I) whose hidden state is h [T, I']: h
        against W2's columns from `first` on [H, I'] (INT8 ones copied into the kept buffer, as the
        product wants contiguous rows), or, where that costs more, h zero-padded to [T, I] against
        the whole of W2 [H, I]."""
        I = self.layout.intermediate
        if not first:
            return h, w2
        if not self.reads_columns((I - first) / I):
            return F.pad(h, (first, 0)), w2
        columns = w2[:, first:]  # [H, I'], strided
        if self.layout.scheme == "none":
            return h, columns
        buffer = self._column_views.get(columns.shape)
        if buffer is None:
            if self._columns.numel() < columns.numel():
                self._columns = torch.empty(columns.numel(), dtype=columns.dtype)
                self._column_views.clear()
            buffer = self._column_views[columns.shape] = self._columns[:columns.numel()].view(columns.shape)
        return h, buffer.copy_(columns)


def _rows(tensor: torch.Tensor, ranges: list[tuple[int, int]] | None) -> list[torch.Tensor]:
    """A w13-shaped tensor's rows in `ranges`, as they come when None (no slicing: each torch call
    lets a worker's GIL go)."""
    return [tensor] if ranges is None else [tensor[a:b] for a, b in ranges]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Products of w13's row ranges side by side [T, 2I']; a single one as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, with no torch call when it already is (each call lets a worker's GIL go)."""
    return x if x.dtype == dtype else x.to(dtype)


def _int8_product(k: int) -> Callable:
    """The INT8 product for a reduction of length k: the vectorised form where k allows it."""
    return _int8_mm if k % VECTOR == 0 else _int8_mm_fp32


def _int8_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ (scale * w)^T -> [T, N] in bf16: the vectorised product (K a multiple of `VECTOR`)."""
    if not x.is_contiguous() or x.data_ptr() % ACT_ALIGN:
        x = x.clone(memory_format=torch.contiguous_format)  # torch's host allocator aligns to 64 bytes
    return torch._weight_int8pack_mm(x, w, scale)


def _int8_mm_fp32(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product for any K through the fp32 form, rounded to bf16 like `_int8_mm`."""
    return torch._weight_int8pack_mm(x.float(), w, scale.float()).to(COMPUTE_DTYPE)
