"""Fused INT8 expert FFN kernels in Triton (paper IV-F; DESIGN.md 2.4, 2.8).

One kernel family computes a MoE layer's routed experts straight from their INT8 blobs: weights
are converted in registers (never written back as bf16), SwiGLU is fused, the routing weights are
applied and each token's routed experts are summed. The kernels see only addresses: a table of one
int64 base address per expert of the layer (0 for an expert with no blob), from which they read
w13, w2 and the scales at the offsets of `ExpertLayout`; a base must be a multiple of 16 bytes (the
weights are read as 16-byte vectors). A base may be a row of the device slot buffer or the
expert's blob in the pinned host store: under unified addressing a pinned host address is valid on
the GPU, so a missed expert is read over PCIe inside the same launch ("zero-copy"), with no
transient slot and no wait for a copy. The kernels never know about the cache.

Two shapes, chosen per call from the number of routed pairs P = T * K (a host integer: no sync):

decode (P <= config.decode_max_pairs): two launches over all routed pairs of the layer.
    1. gate/up, grid (P, I / rows): per routed pair, the gate and up rows against the token,
       SwiGLU, into the fp32 workspace act [P, I]; a program owns one block of block_rows rows,
       or a run of blocks (`programs_per_sm`: fewer, longer-lived programs read pinned experts
       over PCIe faster).
    2. down, grid (T, H / block_rows, K x splits): per token, the down projection of each of its K
       experts, scaled and weighted, in programs of its own (`down_per_pair`; else one program
       walks the K in turn, summing in registers: grid (T, H / block_rows, splits)). With `split`
       the reduction over I is shared by several programs too (more programs than H / block_rows
       alone gives). A row block's programs write their partial sums, and the last of them to
       arrive adds them in a fixed order into out [T, H]: no atomics in the sum, deterministic,
       every output element written.
    Each launch comes as a CUDA-core GEMV (`_gate_up_gemv`, `_down_gemv`: fp32 FMAs, INT8
    converted by integer tricks instead of the quarter-rate int-to-float unit) or on the tensor
    cores (`_gate_up_gemv_mma`, `_down_gemv_mma`: the token padded to 16 columns, weight loads
    pipelined); the tuned configuration picks one per launch and shape.
prefill (larger P): the routed pairs are grouped by expert on the device (`group_by_expert`:
    a counting sort in one program, or a torch sort for many pairs; padding to block_m; no host
    sync), then two grouped tiled GEMMs, each program one (expert, block_m pairs, block_n weight
    rows) tile:
    1. `_gate_up_gemm`: act [P, I] (hidden dtype) = SwiGLU of the pairs' tokens against w13
       (int8-shared: of the pairs' tokens scaled once per pair beforehand, `_scale_pairs`).
    2. `_down_gemm`: y [P, H] = weight * (act @ w2^T), one row per pair; then out = the sum of each
       token's K rows (one deterministic torch reduction into `out`).
    The weight tile is the left operand of the dot (on Hopper the converted INT8 operand stays in
    registers) and the tokens the right one.

`int8-shared` folds its scale vector into the activations (x * s before the gate/up product,
s * y after the down product): no multiply per weight. `int8-row` multiplies each output row once
after its reduction. Accumulation is fp32; hidden may be bf16 (the GPU path) or fp32.

Allocation. Decode allocates no device memory after the first call: the fp32 decode workspace
and the partial sums and arrival counts of down programs sharing rows are made at construction,
the address table on the first call (or at construction given `num_experts`), and the output
goes into `out=` when given. Prefill allocates small index tensors (O(P + E)) through the caching
allocator on every call, and its act/y workspaces unless `max_tokens` and `top_k` were given at
construction (they grow when a larger call comes; int8-shared keeps its scaled token rows in y
until the down launch overwrites it). No path
synchronises with the host: the blob-list form stages the address table in pinned host memory and
copies it without waiting (`forward_bases` takes a device table the caller keeps instead, which
also makes a decode step capturable in a CUDA graph; the runtime keeps one per layer in
mira.cache.tables, without the blob list's per-call checks and staging).

T tokens, E experts in the layer, K routed per token, P = T*K routed pairs, H hidden,
I expert intermediate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mira.kernels.tuning import GemvConfig, KernelConfig, load_config
from mira.models.spec import GluForm
from mira.store.layout import ExpertLayout

_SHARED, _ROW = 0, 1
# Adjacent products a thread of a CUDA-core GEMV adds up before accumulating: the 16 weights of
# one 16-byte load, which the compiler's layout gives one thread when a tile has at least 16
# columns per thread (as every tuned launch has), so that sum needs no exchange between threads.
# Against whole-tile accumulators they need far fewer registers (tools/kernel_sass.py shows how
# many), so more programs fit per SM (benchmarks/kernels_int8.py times both).
PARTIAL_SUM = 16
CUT_PARTS = 32  # shares of an expert's units a cut may fall between where the down loads are masked
_SCHEME_IDS = {"int8-shared": _SHARED, "int8-row": _ROW}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _int8_to_f32(w, CVT: tl.constexpr):
    """INT8 -> fp32, exactly. "native": the int-to-float unit (a quarter-rate unit on recent GPUs).
    "bits": q + 128 placed in the mantissa of 2**23 by integer logic, then one add. "prmt": the same
    with one byte-permute instruction per weight (inline PTX: compiled GPUs only)."""
    if CVT == "prmt":
        bits = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m;
            mov.b32 m, 0x4B000000;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, m, 0x7650;
            prmt.b32 $1, t, m, 0x7651;
            prmt.b32 $2, t, m, 0x7652;
            prmt.b32 $3, t, m, 0x7653;
            }""",
            constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4,
        )
        return bits - 8388736.0
    elif CVT == "bits":
        bits = (w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x80) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _gated(g, u, present, ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr,
           CUBIC: tl.constexpr, GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATED: tl.constexpr,
           NAN_ABSENT: tl.constexpr):
    """The experts' activation from the gate and up outputs (mira.models.spec.GluForm):
    cap(g) * sigmoid(ALPHA * (g + CUBIC g^3)) * (cap(u) + UP_OFFSET), g clamped from above and u
    on both sides at LIMIT first when LIMIT > 0, cap(x) = C tanh(x / C) at GATE_CAP / UP_CAP when
    not 0. SwiGLU is (1, 0, 0, 0, 0, 0); gpt-oss's clamped SwiGLU (1.702, 7, 1, 0, 0, 0); GeGLU
    with the tanh GELU (2 sqrt(2 / pi), 0, 0, 0.044715, 0, 0). Ungated experts (not GATED: `g`
    is the up output, `u` unused) take the squared ReLU (Nemotron-H's)."""
    if GATED:
        if LIMIT > 0:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        inner = g
        if CUBIC != 0.0:
            inner = g + CUBIC * g * g * g
        if GATE_CAP != 0.0:
            linear = _softcap(g, GATE_CAP)
        else:
            linear = g
        if ALPHA == 1.0:
            act = linear * tl.sigmoid(inner)
        else:
            act = linear * tl.sigmoid(inner * ALPHA)
        if UP_CAP != 0.0:
            u = _softcap(u, UP_CAP)
        if UP_OFFSET != 0.0:
            u = u + UP_OFFSET
        out = act * u
    else:
        relu = tl.maximum(g, 0.0)
        out = relu * relu
    return _absent(out, present, NAN_ABSENT)


@triton.jit
def _softcap(x, CAP: tl.constexpr):
    """CAP * tanh(x / CAP), as CAP * (2 sigmoid(2 x / CAP) - 1): Triton has no tanh of its own."""
    return CAP * (2.0 * tl.sigmoid(x * (2.0 / CAP)) - 1.0)


@triton.jit
def _absent(x, present, NAN_ABSENT: tl.constexpr):
    """An expert routed without a blob (address 0): NaN rows, which no caller can miss, or (when
    another executor computes it) the zeros its masked loads already gave."""
    if NAN_ABSENT:
        x = tl.where(present, x, float("nan"))
    return x


@triton.jit
def _bias(base, OFFSET, rows, mask, HAS_BIAS: tl.constexpr):
    """An expert's float32 bias at `rows` (its section at OFFSET in the blob), or 0.0 without biases."""
    if HAS_BIAS:
        return tl.load((base + OFFSET).to(tl.pointer_type(tl.float32)) + rows, mask=mask, other=0.0)
    else:
        return 0.0


@triton.jit
def _gate_up_gemv(
    hidden_ptr, stride_ht, index_ptr, bases_ptr, act_ptr,  # [T, H], [P], [E] int64, [P, I] fp32
    H, I, K, S_IN_OFF, B13_OFF, ROWS, limits_ptr,  # limits_ptr: [E] int32, read with CUT
    SCHEME: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, UNROLL: tl.constexpr,
    EVEN_H: tl.constexpr, CVT: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, CUBIC: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr,
    GATED: tl.constexpr, NAN_ABSENT: tl.constexpr,
    CUT: tl.constexpr,
):
    """Decode launch 1 on the CUDA cores: program (pair, g) -> act[pair, rows], for the ROWS rows
    from g * ROWS (whole blocks of BLOCK_I, one after another); with CUT, only the rows below the
    expert's limit."""
    pair = tl.program_id(0)
    row_start = tl.program_id(1) * ROWS
    token = pair // K
    expert = tl.load(index_ptr + pair)
    base = tl.load(bases_ptr + expert)
    present = base != 0  # an expert routed without a blob yields NaN (or zero), not a fault
    w13 = tl.multiple_of(base.to(tl.pointer_type(tl.int8)), 16)
    s_in = tl.multiple_of((base + S_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    row_end = tl.minimum(row_start + ROWS, I)
    if CUT:
        row_end = tl.minimum(row_end, tl.load(limits_ptr + expert))
    h_limit = tl.where(present, H, 0)
    x_row = hidden_ptr + token * stride_ht
    for i0 in range(row_start, row_end, BLOCK_I):
        _gate_up_rows(x_row, base, w13, s_in, act_ptr + pair * I, i0 + tl.arange(0, BLOCK_I), row_end, present,
                      h_limit, H, I, B13_OFF, SCHEME, BLOCK_I, BLOCK_H, UNROLL, EVEN_H, CVT, VEC, HAS_BIAS, ALPHA,
                      LIMIT, UP_OFFSET, CUBIC, GATE_CAP, UP_CAP, GATED, NAN_ABSENT)


@triton.jit
def _gate_up_rows(
    x_row, base, w13, s_in, act_row, offs_i, row_end, present, h_limit, H, I, B13_OFF,
    SCHEME: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, UNROLL: tl.constexpr,
    EVEN_H: tl.constexpr, CVT: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, CUBIC: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr,
    GATED: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """One block of _gate_up_gemv's rows: act_row[offs_i] for the rows below row_end. Each thread
    sums its VEC adjacent products of a row before accumulating, so the accumulators are
    [BLOCK_I, BLOCK_H / VEC], not a whole tile: fewer registers, more programs per SM."""
    in_rows = offs_i < row_end
    row_mask = offs_i < tl.where(present, row_end, 0)  # (a scalar-bool & tensor-bool is int32 in the interpreter)
    gate_rows = w13 + offs_i[:, None] * H  # [BLOCK_I, 1]
    up_rows = w13 + (offs_i[:, None] + I) * H
    acc_g = tl.zeros([BLOCK_I, BLOCK_H // VEC], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_H // VEC], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H * UNROLL):
        for u in tl.static_range(UNROLL):  # unrolled: the compiler issues all the loads up front
            offs_h = tl.max_contiguous(tl.multiple_of(h0 + u * BLOCK_H + tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
            if EVEN_H:
                x = tl.load(x_row + offs_h).to(tl.float32)
                w_mask = row_mask[:, None]
            else:
                in_h = offs_h < H
                x = tl.load(x_row + offs_h, mask=in_h, other=0.0).to(tl.float32)
                w_mask = row_mask[:, None] & in_h[None, :]
            if SCHEME == 0:  # int8-shared: W13q diag(s) x = W13q (s * x)
                x = x * tl.load(s_in + offs_h, mask=offs_h < h_limit, other=0.0).to(tl.float32)
            wg = tl.load(gate_rows + offs_h[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(up_rows + offs_h[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
            acc_g += tl.sum(tl.reshape(_int8_to_f32(wg, CVT) * x[None, :], [BLOCK_I, BLOCK_H // VEC, VEC]), axis=2)
            if GATED:
                acc_u += tl.sum(tl.reshape(_int8_to_f32(wu, CVT) * x[None, :], [BLOCK_I, BLOCK_H // VEC, VEC]),
                                axis=2)
    g = tl.sum(acc_g, axis=1)  # [BLOCK_I]
    u = tl.sum(acc_u, axis=1)
    if SCHEME == 1:  # int8-row: one scale per output row
        g = g * tl.load(s_in + offs_i, mask=row_mask, other=0.0).to(tl.float32)
        if GATED:
            u = u * tl.load(s_in + I + offs_i, mask=row_mask, other=0.0).to(tl.float32)
    g += _bias(base, B13_OFF, offs_i, row_mask, HAS_BIAS)
    if GATED:
        u += _bias(base, B13_OFF, offs_i + I, row_mask, HAS_BIAS)
    act = _gated(g, u, present, ALPHA, LIMIT, UP_OFFSET, CUBIC, GATE_CAP, UP_CAP, GATED, NAN_ABSENT)
    tl.store(act_row + offs_i, act, mask=in_rows)


@triton.jit
def _down_part(part, I, SPAN, K, PER_PAIR: tl.constexpr):
    """Program `part` of a down launch's row block -> (its split of I, the first of the token's K
    experts it sums and the end of them): all K, or with PER_PAIR one, part = k splits + split."""
    if PER_PAIR:
        splits = tl.cdiv(I, SPAN)
        return part % splits, part // splits, part // splits + 1
    return part, 0, K


@triton.jit
def _store_down_rows(out_row, total, in_rows, partial_ptr, count_ptr, row_block, part, PARTS: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """A down GEMV program's rows of one token: stored at once, or, shared by PARTS programs, its
    partial sums stored and the last program to arrive adds them all in part order."""
    if PARTS == 1:
        tl.store(out_row, total.to(out_row.dtype.element_ty), mask=in_rows)
    else:
        partials = partial_ptr + row_block * PARTS * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(partials + part * BLOCK_H, total)
        tl.debug_barrier()  # every thread's partial is stored before the count moves
        arrived = tl.atomic_add(count_ptr + row_block, 1, sem="acq_rel")
        if arrived == PARTS - 1:  # the last to arrive: the others' partials are visible to it
            total = tl.zeros([BLOCK_H], dtype=tl.float32)
            for s in range(0, PARTS):
                total += tl.load(partials + s * BLOCK_H, cache_modifier=".cg")  # from L2, not a stale L1 line
            tl.store(out_row, total.to(out_row.dtype.element_ty), mask=in_rows)
            tl.atomic_xchg(count_ptr + row_block, 0)  # ready for the next call


@triton.jit
def _down_gemv(
    act_ptr, index_ptr, weights_ptr, bases_ptr, out_ptr, stride_ot,  # [P, I] fp32, [P], [P], [E], [T, H]
    partial_ptr, count_ptr,  # [T, H / BLOCK_H, PARTS, BLOCK_H] fp32, [T, H / BLOCK_H] int32 zeros (PARTS > 1)
    H, I, K, W2_OFF, S_OUT_OFF, B2_OFF, SPAN, limits_ptr,  # limits_ptr: [E] int32, read with CUT
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, UNROLL: tl.constexpr, PARTS: tl.constexpr,
    PER_PAIR: tl.constexpr, EVEN_I: tl.constexpr, CVT: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
    NAN_ABSENT: tl.constexpr, CUT: tl.constexpr,
):
    """Decode launch 2 on the CUDA cores: program (token, block of H rows, part) -> the token's K
    experts summed in registers over columns [s * SPAN, (s + 1) * SPAN) of I, split s = part;
    PER_PAIR: expert k's alone, part = k S + s of S splits. A row block's PARTS programs add up:
    alone (PARTS 1), its sum is out[token, rows]; else each program writes its partial sum and
    counts itself in, and the last to arrive adds the partials in part order into out and resets
    the count: deterministic, no second launch, more programs for a short H or many experts.
    Partial sums of VEC adjacent products per thread, as in _gate_up_rows."""
    token = tl.program_id(0)
    block = tl.program_id(1)
    split, k_first, k_end = _down_part(tl.program_id(2), I, SPAN, K, PER_PAIR)
    offs_h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = offs_h < H
    col_start = split * SPAN
    col_end = tl.minimum(col_start + SPAN, I)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(k_first, k_end):
        pair = token * K + k
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        expert = tl.load(index_ptr + pair)
        base = tl.load(bases_ptr + expert)
        present = base != 0
        w2 = tl.multiple_of((base + W2_OFF).to(tl.pointer_type(tl.int8)), 16)
        s_out = tl.multiple_of((base + S_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
        row_mask = offs_h < tl.where(present, H, 0)
        rows = w2 + offs_h[:, None] * I  # [BLOCK_H, 1]
        act_row = act_ptr + pair * I
        cols_end = col_end
        if CUT:
            cols_end = tl.minimum(col_end, tl.load(limits_ptr + expert))
        acc = tl.zeros([BLOCK_H, BLOCK_I // VEC], dtype=tl.float32)
        for i0 in range(col_start, cols_end, BLOCK_I * UNROLL):
            for u in tl.static_range(UNROLL):
                offs_i = tl.max_contiguous(tl.multiple_of(i0 + u * BLOCK_I + tl.arange(0, BLOCK_I), BLOCK_I), BLOCK_I)
                if EVEN_I:
                    a = tl.load(act_row + offs_i)
                    w_mask = row_mask[:, None]
                else:
                    in_i = offs_i < cols_end
                    a = tl.load(act_row + offs_i, mask=in_i, other=0.0)
                    w_mask = row_mask[:, None] & in_i[None, :]
                w = tl.load(rows + offs_i[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
                acc += tl.sum(tl.reshape(_int8_to_f32(w, CVT) * a[None, :], [BLOCK_H, BLOCK_I // VEC, VEC]), axis=2)
        y = tl.sum(acc, axis=1) * tl.load(s_out + offs_h, mask=row_mask, other=0.0).to(tl.float32)
        y += _bias(base, B2_OFF, offs_h, offs_h < tl.where(present & (split == 0), H, 0), HAS_BIAS)  # once: split 0's
        total += _absent(y, present, NAN_ABSENT) * weight
    _store_down_rows(out_ptr + token * stride_ot + offs_h, total, in_rows, partial_ptr, count_ptr,
                     token * tl.num_programs(1) + block, tl.program_id(2), PARTS, BLOCK_H)


@triton.jit
def _gate_up_gemv_mma(
    hidden_ptr, stride_ht, index_ptr, bases_ptr, act_ptr,  # as _gate_up_gemv
    H, I, K, S_IN_OFF, B13_OFF,
    SCHEME: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, CUBIC: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr,
    GATED: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """_gate_up_gemv on the tensor cores: the pair's token is column 0 of a 16-column right
    operand (the other columns are zero), the weights the left one. The MMA work is wasted
    15/16, which costs nothing in a memory-bound launch, and the weight loads are pipelined."""
    pair = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    token = pair // K
    base = tl.load(bases_ptr + tl.load(index_ptr + pair))
    present = base != 0
    w13 = tl.multiple_of(base.to(tl.pointer_type(tl.int8)), 16)
    s_in = tl.multiple_of((base + S_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    in_rows = offs_i < I
    row_mask = offs_i < tl.where(present, I, 0)
    h_limit = tl.where(present, H, 0)
    gate_rows = w13 + offs_i[:, None] * H  # [BLOCK_I, 1]
    up_rows = w13 + (offs_i[:, None] + I) * H
    x_row = hidden_ptr + token * stride_ht
    first = (tl.arange(0, 16) == 0)[None, :]  # [1, 16]
    acc_g = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = tl.max_contiguous(tl.multiple_of(h0 + tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
        if EVEN_H:
            x = tl.load(x_row + offs_h).to(tl.float32)
            w_mask = row_mask[:, None]
        else:
            in_h = offs_h < H
            x = tl.load(x_row + offs_h, mask=in_h, other=0.0).to(tl.float32)
            w_mask = row_mask[:, None] & in_h[None, :]
        if SCHEME == 0:
            x = x * tl.load(s_in + offs_h, mask=offs_h < h_limit, other=0.0).to(tl.float32)
        x_t = tl.where(first, x[:, None], 0.0).to(hidden_ptr.dtype.element_ty).to(DOT_DTYPE)  # [BLOCK_H, 16]
        wg = tl.load(gate_rows + offs_h[None, :], mask=w_mask, other=0).to(DOT_DTYPE)  # [BLOCK_I, BLOCK_H]
        if GATED:
            wu = tl.load(up_rows + offs_h[None, :], mask=w_mask, other=0).to(DOT_DTYPE)
        acc_g = tl.dot(wg, x_t, acc_g, input_precision=PRECISION)
        if GATED:
            acc_u = tl.dot(wu, x_t, acc_u, input_precision=PRECISION)
    g = tl.sum(acc_g, axis=1)  # columns 1..15 are zero
    u = tl.sum(acc_u, axis=1)
    if SCHEME == 1:
        g = g * tl.load(s_in + offs_i, mask=row_mask, other=0.0).to(tl.float32)
        if GATED:
            u = u * tl.load(s_in + I + offs_i, mask=row_mask, other=0.0).to(tl.float32)
    g += _bias(base, B13_OFF, offs_i, row_mask, HAS_BIAS)
    if GATED:
        u += _bias(base, B13_OFF, offs_i + I, row_mask, HAS_BIAS)
    act = _gated(g, u, present, ALPHA, LIMIT, UP_OFFSET, CUBIC, GATE_CAP, UP_CAP, GATED, NAN_ABSENT)
    tl.store(act_ptr + pair * I + offs_i, act, mask=in_rows)


@triton.jit
def _down_gemv_mma(
    act_ptr, index_ptr, weights_ptr, bases_ptr, out_ptr, stride_ot,  # as _down_gemv
    H, I, K, W2_OFF, S_OUT_OFF, B2_OFF,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, EVEN_I: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """_down_gemv on the tensor cores (see _gate_up_gemv_mma); act is rounded to the output
    dtype for the product, as the reference does."""
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = offs_h < H
    first = (tl.arange(0, 16) == 0)[None, :]
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, K):
        pair = token * K + k
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        base = tl.load(bases_ptr + tl.load(index_ptr + pair))
        present = base != 0
        w2 = tl.multiple_of((base + W2_OFF).to(tl.pointer_type(tl.int8)), 16)
        s_out = tl.multiple_of((base + S_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
        row_mask = offs_h < tl.where(present, H, 0)
        rows = w2 + offs_h[:, None] * I
        act_row = act_ptr + pair * I
        acc = tl.zeros([BLOCK_H, 16], dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            offs_i = tl.max_contiguous(tl.multiple_of(i0 + tl.arange(0, BLOCK_I), BLOCK_I), BLOCK_I)
            if EVEN_I:
                a = tl.load(act_row + offs_i)
                w_mask = row_mask[:, None]
            else:
                in_i = offs_i < I
                a = tl.load(act_row + offs_i, mask=in_i, other=0.0)
                w_mask = row_mask[:, None] & in_i[None, :]
            a_t = tl.where(first, a[:, None], 0.0).to(out_ptr.dtype.element_ty).to(DOT_DTYPE)  # [BLOCK_I, 16]
            w = tl.load(rows + offs_i[None, :], mask=w_mask, other=0).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_I]
            acc = tl.dot(w, a_t, acc, input_precision=PRECISION)
        y = tl.sum(acc, axis=1) * tl.load(s_out + offs_h, mask=row_mask, other=0.0).to(tl.float32)
        y += _bias(base, B2_OFF, offs_h, row_mask, HAS_BIAS)
        total += _absent(y, present, NAN_ABSENT) * weight
    tl.store(out_ptr + token * stride_ot + offs_h, total.to(out_ptr.dtype.element_ty), mask=in_rows)


@triton.jit
def _scale_pairs(
    hidden_ptr, stride_ht, index_ptr, bases_ptr, xs_ptr,  # [T, H], [P], [E] int64, [P, H] (hidden dtype)
    H, K, S_IN_OFF,
    BLOCK: tl.constexpr,
):
    """int8-shared prefill: xs[pair] = x[token] * s of the pair's expert, rounded to the hidden
    dtype, once per pair, so that the gate/up GEMM reads its token operand straight from memory
    (scaled inside its loop, the operand passes through registers and each step's tensor-core
    product must finish before the next step's operand is stored: no overlap)."""
    pair = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = tl.load(bases_ptr + tl.load(index_ptr + pair))
    s_in = tl.multiple_of((base + S_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    x = tl.load(hidden_ptr + (pair // K) * stride_ht + offs, mask=offs < H, other=0.0).to(tl.float32)
    s = tl.load(s_in + offs, mask=offs < tl.where(base != 0, H, 0), other=0.0).to(tl.float32)
    tl.store(xs_ptr + pair * H + offs, (x * s).to(xs_ptr.dtype.element_ty), mask=offs < H)


@triton.jit
def _gate_up_gemm(
    x_ptr, stride_xt, sorted_pair_ptr, block_expert_ptr, bases_ptr, act_ptr,  # act [P, I]
    P, H, I, K, S_IN_OFF, B13_OFF,
    SCHEME: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, CUBIC: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr,
    GATED: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """Prefill launch 1: program (block of one expert's pairs, block of I rows) -> act rows. The
    pairs' token rows are x's rows pair // K: the hidden states (int8-row) or the pairs' scaled
    rows from `_scale_pairs` (int8-shared, K = 1)."""
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert < 0:  # past the last padded block of this call
        return
    base = tl.load(bases_ptr + expert)
    present = base != 0
    w13 = tl.multiple_of(base.to(tl.pointer_type(tl.int8)), 16)
    s_in = tl.multiple_of((base + S_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    pairs = tl.load(sorted_pair_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    valid = pairs < P
    tokens = pairs // K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = offs_n < I
    row_mask = offs_n < tl.where(present, I, 0)
    x_cols = x_ptr + tokens[None, :] * stride_xt  # [1, BM]
    gate_rows = w13 + offs_n[:, None] * H  # [BN, 1]
    up_rows = w13 + (offs_n[:, None] + I) * H
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        if EVEN_K:
            x_mask = valid[None, :]
            w_mask = row_mask[:, None]
        else:
            in_k = offs_k < H
            x_mask = valid[None, :] & in_k[:, None]
            w_mask = row_mask[:, None] & in_k[None, :]
        x_t = tl.load(x_cols + offs_k[:, None], mask=x_mask, other=0.0).to(DOT_DTYPE)  # [BK, BM]
        wg = tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0).to(DOT_DTYPE)  # [BN, BK]
        if GATED:
            wu = tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0).to(DOT_DTYPE)
        acc_g = tl.dot(wg, x_t, acc_g, input_precision=PRECISION)  # [BN, BM]
        if GATED:
            acc_u = tl.dot(wu, x_t, acc_u, input_precision=PRECISION)
    if SCHEME == 1:
        acc_g = acc_g * tl.load(s_in + offs_n, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_u = acc_u * tl.load(s_in + I + offs_n, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc_g += _bias(base, B13_OFF, offs_n, row_mask, HAS_BIAS)[:, None]
        if GATED:
            acc_u += _bias(base, B13_OFF, offs_n + I, row_mask, HAS_BIAS)[:, None]
    act = _gated(acc_g, acc_u, present, ALPHA, LIMIT, UP_OFFSET, CUBIC, GATE_CAP, UP_CAP, GATED, NAN_ABSENT)
    tl.store(act_ptr + pairs[None, :] * I + offs_n[:, None], act.to(act_ptr.dtype.element_ty),
             mask=valid[None, :] & in_rows[:, None])


@triton.jit
def _down_gemm(
    act_ptr, sorted_pair_ptr, block_expert_ptr, bases_ptr, weights_ptr, y_ptr,  # act [P, I], y [P, H]
    P, H, I, W2_OFF, S_OUT_OFF, B2_OFF,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    NAN_ABSENT: tl.constexpr,
):
    """Prefill launch 2: program (block of one expert's pairs, block of H rows) -> y rows,
    scaled and weighted (one row per pair; the launcher sums each token's K rows)."""
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert < 0:
        return
    base = tl.load(bases_ptr + expert)
    present = base != 0
    w2 = tl.multiple_of((base + W2_OFF).to(tl.pointer_type(tl.int8)), 16)
    s_out = tl.multiple_of((base + S_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    pairs = tl.load(sorted_pair_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < P
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = offs_n < H
    row_mask = offs_n < tl.where(present, H, 0)
    a_cols = act_ptr + pairs[None, :] * I  # [1, BM]
    rows = w2 + offs_n[:, None] * I  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        if EVEN_K:
            a_mask = valid[None, :]
            w_mask = row_mask[:, None]
        else:
            in_k = offs_k < I
            a_mask = valid[None, :] & in_k[:, None]
            w_mask = row_mask[:, None] & in_k[None, :]
        a_t = tl.load(a_cols + offs_k[:, None], mask=a_mask, other=0.0).to(DOT_DTYPE)  # [BK, BM]
        w = tl.load(rows + offs_k[None, :], mask=w_mask, other=0).to(DOT_DTYPE)  # [BN, BK]
        acc = tl.dot(w, a_t, acc, input_precision=PRECISION)
    scale = tl.load(s_out + offs_n, mask=row_mask, other=0.0).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    y = acc * scale[:, None]
    if HAS_BIAS:
        y += _bias(base, B2_OFF, offs_n, row_mask, HAS_BIAS)[:, None]
    y = y * weight[None, :]
    y = _absent(y, present, NAN_ABSENT)
    tl.store(y_ptr + pairs[None, :] * H + offs_n[:, None], y.to(y_ptr.dtype.element_ty),
             mask=valid[None, :] & in_rows[:, None])


def partial_sum(gemv: GemvConfig) -> int:
    """Adjacent products a thread of this CUDA-core GEMV launch adds up before accumulating
    (PARTIAL_SUM, or the tile's width when narrower)."""
    return min(PARTIAL_SUM, gemv.block_cols)


def split_span(intermediate: int, gemv: GemvConfig) -> tuple[int, int]:
    """Columns of I per program of a (split) down launch on the CUDA cores, in whole loop steps
    of block_cols x unroll, and the number of programs sharing a row: (span, splits)."""
    step = gemv.block_cols * gemv.unroll
    span = triton.cdiv(triton.cdiv(intermediate, gemv.split), step) * step
    return span, triton.cdiv(intermediate, span)


def cut_granule(config: KernelConfig, intermediate: int) -> int | None:
    """The unit count a cut point of an expert of `intermediate` units must be a multiple of under
    `config`: a whole loop step of a down GEMV whose loads are unmasked, else I / CUT_PARTS (masked
    loads stop anywhere); None where the configuration cannot cut (tensor-core decode products)."""
    up, down = config.gate_up_gemv, config.down_gemv
    if up.mma or down.mma:
        return None
    span, _ = split_span(intermediate, down)
    if triton.cdiv(intermediate, span) * span == intermediate:  # _decode's EVEN_I
        return down.block_cols * down.unroll
    return triton.cdiv(intermediate, CUT_PARTS)


class TritonMoEFFN:
    """The routed experts of one MoE layer from their INT8 blobs, on the fused Triton kernels.

    One instance serves every layer of a model (they share the blob layout); calls on one stream
    share its workspaces. On a CPU device it runs only under `TRITON_INTERPRET=1` (the tests).
    """

    # scheme -> how its scales are laid out; a subclass for other blobs (mira.kernels.triton_int4)
    # names its own and replaces _decode and _prefill_gemm
    schemes = _SCHEME_IDS

    def __init__(
        self,
        layout: ExpertLayout,
        device: torch.device | str,
        *,
        config: KernelConfig | None = None,
        num_experts: int | None = None,
        max_tokens: int | None = None,
        top_k: int | None = None,
        dtype: torch.dtype | None = None,
        glu: GluForm = GluForm(),
        ungated: str | None = None,
        absent_zero: bool = False,
    ) -> None:
        """
        Args:
            layout: the blob layout of the store; its scheme one these kernels read (`schemes`:
                int8-shared or int8-row here); biases are read when it has them.
            device: where the kernels run ("cuda", "cuda:N"; "cpu" under TRITON_INTERPRET=1).
            config: launch configuration; default: the stored tuning for this device and shape
                (`mira.kernels.tuning.load_config`).
            num_experts: experts per layer (E), to allocate the address table now.
            max_tokens, top_k: with both given, the prefill workspaces for max_tokens * top_k
                routed pairs are allocated now (in `dtype`, default bf16 on CUDA, fp32 on CPU).
            glu: the experts' gated activation (default SwiGLU).
            ungated: the activation of ungated experts (`layout.gated` False): "relu2", the squared
                ReLU, the one these kernels compute (mira.kernels.ungated_form).
            absent_zero: a routed expert with address 0 adds zero instead of NaN rows (another
                executor computes it).

        Raises:
            ValueError: the scheme has no kernel here, ungated experts without "relu2", a blob would need
                offsets beyond int32, or the configuration cannot run (`_validate`).
        """
        if layout.scheme not in self.schemes:
            raise ValueError(
                f"these fused kernels read {' or '.join(self.schemes)} blobs, not {layout.scheme!r}; "
                "use mira.kernels.make_moe_ffn, which falls back to the PyTorch reference"
            )
        if not layout.gated and ungated != "relu2":
            raise ValueError(f"the fused kernels compute ungated experts with the squared ReLU only (ungated='relu2'), "
                             f"not {ungated!r}; use mira.kernels.make_moe_ffn, which falls back to the PyTorch reference")
        if layout.nbytes >= 2**31:
            raise ValueError(f"an expert blob of {layout.nbytes} bytes needs 64-bit offsets, which these kernels do not use")
        self.layout = layout
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        H, I = layout.hidden, layout.intermediate
        if config is None:
            name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
            config = self._stored_config(name, H, I)
        self._validate(config)
        self.config = config
        self._scheme = self.schemes[layout.scheme]
        sections = layout.sections
        self._w2_off = sections["w2"].offset
        self._s_in_off, self._s_out_off = self._scale_offsets(sections)
        self._b13_off = sections["b13"].offset if layout.bias else 0
        self._b2_off = sections["b2"].offset if layout.bias else 0
        # what follows each product: the bias, the gating, what an absent expert gives (constexprs)
        self._after_up = dict(HAS_BIAS=layout.bias, ALPHA=float(glu.alpha), LIMIT=float(glu.limit or 0.0),
                              UP_OFFSET=float(glu.up_offset), CUBIC=float(glu.cubic),
                              GATE_CAP=float(glu.gate_cap or 0.0), UP_CAP=float(glu.up_cap or 0.0),
                              GATED=layout.gated, NAN_ABSENT=not absent_zero)
        self._after_down = dict(HAS_BIAS=layout.bias, NAN_ABSENT=not absent_zero)
        self._decode_act = torch.empty(config.decode_max_pairs, I, dtype=torch.float32, device=self.device)
        self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        # partial sums and arrival counts of down programs sharing rows (the counts are back at zero after every call)
        down = config.down_gemv
        self._down_span, splits = self._down_split(I, down)
        row_blocks = config.decode_max_pairs * triton.cdiv(H, down.block_rows) if self._rows_shared(splits) else 0
        self._split_partials = torch.empty(row_blocks * splits * down.block_rows, dtype=torch.float32, device=self.device)
        self._split_counts = torch.zeros(row_blocks, dtype=torch.int32, device=self.device)
        self._bases = None if num_experts is None else torch.zeros(num_experts, dtype=torch.int64, device=self.device)
        self._prefill: dict[str, torch.Tensor] = {}
        if max_tokens is not None and top_k is not None:
            dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
            self._prefill_buffers(max_tokens * top_k, dtype)

    # what a scheme's kernels read their own way (mira.kernels.triton_int4 overrides these)

    def _stored_config(self, device_name: str, hidden: int, intermediate: int) -> KernelConfig:
        """The stored tuning of this device and shape (`mira.kernels.tuning.load_config`)."""
        return load_config(device_name, hidden, intermediate)

    def _validate(self, config: KernelConfig) -> None:
        """Raise ValueError for a configuration these kernels cannot run (the INT8 ones run any)."""

    def _scale_offsets(self, sections: dict) -> tuple[int, int]:
        """Blob offsets of the scales the gate/up and the down products read."""
        shared = self._scheme == _SHARED
        return sections["scale" if shared else "scale13"].offset, sections["scale" if shared else "scale2"].offset

    def _down_split(self, intermediate: int, down: GemvConfig) -> tuple[int, int]:
        """Columns of I per program of the down launch, and the programs sharing a row."""
        return (intermediate, 1) if down.mma else split_span(intermediate, down)

    def _rows_shared(self, splits: int) -> bool:
        """Whether several down programs may share a token's rows (their partial sums in a workspace):
        split, or the token's experts apart (`KernelConfig.down_per_pair`, not on the tensor cores)."""
        return splits > 1 or (self.config.down_per_pair and not self.config.down_gemv.mma)

    def workspace_bytes(self, tokens: int, top_k: int, dtype: torch.dtype) -> int:
        """Device bytes of the workspaces one call of this size uses (for the memory budget)."""
        H, I, pairs = self.layout.hidden, self.layout.intermediate, tokens * top_k
        decode = self.config.decode_max_pairs * I * 4 + (self._split_partials.numel() + self._split_counts.numel()) * 4
        if pairs <= self.config.decode_max_pairs:
            return decode
        return decode + pairs * (I + H) * dtype.itemsize

    def __call__(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        blobs: Sequence[torch.Tensor | None],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like `moe_ffn_reference` (same arguments but layout and act, fixed at construction).

        Args:
            hidden: [T, H] bf16 or fp32 token states.
            top_k_index: [T, K] routed expert ids.
            top_k_weights: [T, K] routing weights.
            blobs: length E; expert e's uint8 blob (a device slot row, or its pinned host blob),
                or None when e is not routed. A routed expert given None yields NaN rows.
            out: optional [T, H] output in hidden's dtype, written in full (else allocated).

        Returns:
            out, [T, H].

        Raises:
            ValueError: a blob has the wrong size or type, or lives in pageable host memory.
        """
        return self.forward_bases(hidden, top_k_index, top_k_weights, self._address_table(blobs), out=out)

    def forward_bases(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        bases: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        limits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The same with an address table the caller keeps on the device: bases [E] int64, the
        blob address of every expert of the layer (0 for none). Enqueues kernels only: no host
        sync, and in decode no allocation when `out` is given.

        `limits` [E] int32 on the device cuts experts: expert e computes only its intermediate units
        [0, limits[e]), each limit I or a multiple of `cut_granule` (the CPU computes the rest of a
        cut expert). Decode calls only.
        """
        T, H = hidden.shape
        K = top_k_index.shape[1]
        if H != self.layout.hidden or top_k_index.shape[0] != T or top_k_weights.shape != top_k_index.shape:
            raise ValueError(
                f"expected hidden [T, {self.layout.hidden}] with top_k_index and top_k_weights [T, K]; got "
                f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
            )
        if out is None:
            out = torch.empty_like(hidden)
        elif out.shape != hidden.shape or out.dtype != hidden.dtype or out.stride(1) != 1:
            raise ValueError(f"out must be a [T, H] {hidden.dtype} tensor with unit stride along H")
        if T == 0:
            return out
        if hidden.stride(1) != 1:
            hidden = hidden.contiguous()
        index = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1)
        decode = T * K <= self.config.decode_max_pairs
        if limits is not None and (not decode or self.cut_granule is None):
            raise ValueError("only the CUDA-core decode GEMVs cut experts (see cut_granule): pass limits=None")
        if decode:
            self._decode(hidden, index, weights, bases, out, K, limits)
        else:
            self._prefill_gemm(hidden, index, weights, bases, out, K)
        return out

    @property
    def cut_granule(self) -> int | None:
        """The unit count an expert's cut point must be a multiple of (`forward_bases(limits=...)`,
        `cut_granule`)."""
        return cut_granule(self.config, self.layout.intermediate)

    def _address_table(self, blobs: Sequence[torch.Tensor | None]) -> torch.Tensor:
        nbytes, on_cuda = self.layout.nbytes, self.device.type == "cuda"
        addresses = []
        for expert, blob in enumerate(blobs):
            if blob is None:
                addresses.append(0)
                continue
            if blob.dtype != torch.uint8 or blob.dim() != 1 or blob.numel() != nbytes or blob.stride(0) != 1:
                raise ValueError(f"expert {expert}'s blob must be {nbytes} contiguous uint8 bytes, got {blob.dtype} {tuple(blob.shape)}")
            if blob.data_ptr() % 16:
                raise ValueError(
                    f"expert {expert}'s blob starts at an address that is not a multiple of 16 bytes; the kernels "
                    "read 16-byte vectors: place blobs at aligned offsets (slot rows and store rows of ExpertLayout.nbytes are)"
                )
            if on_cuda and not blob.is_cuda and not blob.is_pinned():
                raise ValueError(
                    f"expert {expert}'s blob is in pageable host memory, which the GPU cannot read; "
                    "keep the store in pinned memory (pin_memory=True) or copy the blob into a slot"
                )
            addresses.append(blob.data_ptr())
        if self._bases is None or self._bases.numel() != len(addresses):
            self._bases = torch.zeros(len(addresses), dtype=torch.int64, device=self.device)
        if not on_cuda:
            self._bases.copy_(torch.tensor(addresses, dtype=torch.int64))
        else:  # pinned staging from the caching host allocator: reused only once its copy is done
            staging = torch.tensor(addresses, dtype=torch.int64, pin_memory=True)
            self._bases.copy_(staging, non_blocking=True)
        return self._bases

    def _decode(self, hidden, index, weights, bases, out, K, limits=None) -> None:
        T, H = hidden.shape
        I, cfg = self.layout.intermediate, self.config
        up, down = cfg.gate_up_gemv, cfg.down_gemv
        act = self._decode_act  # [>= P, I] fp32
        dot_dtype, precision = self._dot_types(hidden.dtype)
        grid = (T * K, triton.cdiv(I, up.block_rows))
        args = (hidden, hidden.stride(0), index, bases, act, H, I, K, self._s_in_off, self._b13_off)
        launch = dict(num_warps=up.num_warps, num_stages=up.num_stages, **self._after_up)
        if up.mma:
            _gate_up_gemv_mma[grid](
                *args, SCHEME=self._scheme, BLOCK_I=up.block_rows, BLOCK_H=up.block_cols,
                EVEN_H=H % up.block_cols == 0, DOT_DTYPE=dot_dtype, PRECISION=precision, **launch,
            )
        else:
            rows = self._rows_per_program(T * K, up)
            _gate_up_gemv[(T * K, triton.cdiv(I, rows))](
                *args, rows, bases if limits is None else limits, SCHEME=self._scheme, BLOCK_I=up.block_rows,
                BLOCK_H=up.block_cols, UNROLL=up.unroll, EVEN_H=H % (up.block_cols * up.unroll) == 0,
                CVT=self._cvt(up), VEC=partial_sum(up), CUT=limits is not None, **launch,
            )
        grid = (T, triton.cdiv(H, down.block_rows))
        args = (act, index, weights, bases, out, out.stride(0), H, I, K, self._w2_off, self._s_out_off, self._b2_off)
        launch = dict(num_warps=down.num_warps, num_stages=down.num_stages, **self._after_down)
        if down.mma:
            _down_gemv_mma[grid](
                *args, BLOCK_H=down.block_rows, BLOCK_I=down.block_cols,
                EVEN_I=I % down.block_cols == 0, DOT_DTYPE=dot_dtype, PRECISION=precision, **launch,
            )
        else:
            span = self._down_span
            splits = triton.cdiv(I, span)
            parts = splits * (K if cfg.down_per_pair else 1)
            _down_gemv[(*grid, parts)](
                *args[:6], self._split_partials, self._split_counts, *args[6:], span,
                bases if limits is None else limits, BLOCK_H=down.block_rows, BLOCK_I=down.block_cols,
                UNROLL=down.unroll, PARTS=parts, PER_PAIR=cfg.down_per_pair, EVEN_I=splits * span == I,
                CVT=self._cvt(down), VEC=partial_sum(down), CUT=limits is not None, **launch,
            )

    def _rows_per_program(self, pairs: int, gemv: GemvConfig) -> int:
        """Rows of one routed pair a gate/up program owns: one block, or with `programs_per_sm`
        the pair's share of about that many programs per SM, in whole blocks."""
        if gemv.programs_per_sm <= 0:
            return gemv.block_rows
        programs = max(1, self._sms * gemv.programs_per_sm // pairs)
        return triton.cdiv(triton.cdiv(self.layout.intermediate, programs), gemv.block_rows) * gemv.block_rows

    def _dot_types(self, dtype: torch.dtype):
        """Operand dtype and precision of the tensor-core products: the hidden dtype on the GPU
        (fp32 exactly, not tf32); fp32 in the interpreter, whose bf16 products and int8-to-bf16
        conversions are wrong (Triton 3.9); bf16 operands are exact in fp32, so only the
        accumulation order differs."""
        if self.device.type != "cuda":
            return tl.float32, "ieee"
        return _TL_DTYPES[dtype], ("ieee" if dtype == torch.float32 else "tf32")

    def _cvt(self, gemv: GemvConfig) -> str:
        """"prmt" converts 4 weights per instruction: it needs a multiple of 4 weights per thread
        and compiled code (the interpreter has no inline PTX); otherwise "bits"."""
        per_thread = gemv.block_rows * gemv.block_cols // (32 * gemv.num_warps)
        if gemv.cvt == "prmt" and (self.device.type != "cuda" or per_thread % 4):
            return "bits"
        return gemv.cvt

    def _prefill_buffers(self, pairs: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        H, I = self.layout.hidden, self.layout.intermediate
        act, y = self._prefill.get("act"), self._prefill.get("y")
        if act is None or act.dtype != dtype or act.numel() < pairs * I:
            act = self._prefill["act"] = torch.empty(pairs * I, dtype=dtype, device=self.device)
            y = self._prefill["y"] = torch.empty(pairs * H, dtype=dtype, device=self.device)
        return act[: pairs * I].view(pairs, I), y[: pairs * H].view(pairs, H)

    def _prefill_gemm(self, hidden, index, weights, bases, out, K) -> None:
        T, H = hidden.shape
        I, g = self.layout.intermediate, self.config.gemm
        P = T * K
        sorted_pair, block_expert = group_by_expert(index, bases.numel(), g.block_m)
        act, y = self._prefill_buffers(P, hidden.dtype)
        dot_dtype, precision = self._dot_types(hidden.dtype)
        n_blocks = block_expert.numel()
        x, x_stride, x_k = hidden, hidden.stride(0), K  # the GEMM's token rows: pair // x_k of x
        if self._scheme == _SHARED:  # the pairs' scaled rows, in y until the down launch writes it
            _scale_pairs[(P, triton.cdiv(H, 1024))](hidden, hidden.stride(0), index, bases, y, H, K, self._s_in_off, BLOCK=1024)
            x, x_stride, x_k = y, H, 1
        _gate_up_gemm[(n_blocks, triton.cdiv(I, g.block_n))](
            x, x_stride, sorted_pair, block_expert, bases, act,
            P, H, I, x_k, self._s_in_off, self._b13_off,
            SCHEME=self._scheme, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
            EVEN_K=H % g.block_k == 0, DOT_DTYPE=dot_dtype, PRECISION=precision,
            num_warps=g.num_warps, num_stages=g.num_stages, **self._after_up,
        )
        _down_gemm[(n_blocks, triton.cdiv(H, g.block_n))](
            act, sorted_pair, block_expert, bases, weights, y,
            P, H, I, self._w2_off, self._s_out_off, self._b2_off,
            BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
            EVEN_K=I % g.block_k == 0, DOT_DTYPE=dot_dtype, PRECISION=precision,
            num_warps=g.num_warps, num_stages=g.num_stages, **self._after_down,
        )
        torch.sum(y.view(T, K, H), dim=1, out=out)  # each token's K weighted expert outputs


def group_by_expert(index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group routed pairs by expert, each group padded to whole blocks of `block_m` (no host sync).

    Args:
        index: [P] expert id of every routed pair (pair p = token p // K, slot p % K).
        num_experts: E.
        block_m: pairs per block.

    Returns:
        sorted_pair [n_blocks * block_m] int32: pair ids, expert by expert in ascending order,
            ascending within an expert; padding holds P.
        block_expert [n_blocks] int32: the expert of each block; -1 past the last used block.
        n_blocks = P // block_m + min(E, P) bounds the blocks any routing can need.
    """
    P = index.numel()
    n_blocks = P // block_m + min(num_experts, P)
    if P * triton.next_power_of_2(num_experts) > ONE_PROGRAM_GROUPING:
        return _group_by_sorting(index, num_experts, block_m, n_blocks)
    return _group_in_one_program(index, num_experts, block_m, n_blocks)


# Pairs x experts (rounded up to a power of two) up to which group_by_expert runs as one program,
# which walks every pair: much faster than the torch ops for a layer's prefill of a few hundred
# tokens, slower for thousands of pairs over many experts (`grouping` in
# benchmarks/results/kernels-h200.json).
ONE_PROGRAM_GROUPING = 1 << 16


def _group_in_one_program(index: torch.Tensor, num_experts: int, block_m: int, n_blocks: int):
    """group_by_expert as one launch of `_group_pairs`."""
    P, device, experts = index.numel(), index.device, triton.next_power_of_2(num_experts)
    sorted_pair = torch.empty(n_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=device)
    _group_pairs[(1,)](
        index, sorted_pair, block_expert, P, num_experts, n_blocks,
        BLOCK_M=block_m, EXPERTS=experts, CHUNK=max(16, 8192 // experts), num_warps=4,
    )
    return sorted_pair, block_expert


def _group_by_sorting(index: torch.Tensor, num_experts: int, block_m: int, n_blocks: int):
    """group_by_expert for many pairs: a stable sort and a dozen torch ops, no host sync."""
    P, device = index.numel(), index.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.int64))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E]
    sorted_expert, order = torch.sort(index, stable=True)  # [P]
    rank = torch.arange(P, device=device) - (counts.cumsum(0) - counts)[sorted_expert]
    destination = (padded_end - padded)[sorted_expert] + rank
    sorted_pair = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=device)
    sorted_pair[destination] = order.to(torch.int32)
    block_start = torch.arange(n_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # [n_blocks]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair, block_expert


@triton.jit
def _group_pairs(
    index_ptr, sorted_pair_ptr, block_expert_ptr,  # [P] int64, [n_blocks * BLOCK_M] int32, [n_blocks] int32
    P, E, n_blocks,
    BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
):
    """group_by_expert in one program: a counting sort over chunks of CHUNK pairs, with a
    [CHUNK, EXPERTS] one-hot (EXPERTS: E rounded up to a power of two) giving every pair's rank
    among the earlier pairs of its expert."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for c in range(0, P, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        expert = tl.load(index_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [EXPERTS]
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    for b0 in range(0, n_blocks, CHUNK):  # every block's expert
        blocks = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        tl.store(block_expert_ptr + blocks, tl.where(owner < E, owner, -1), mask=blocks < n_blocks)
    for s0 in range(0, n_blocks * BLOCK_M, CHUNK):  # every slot padding, until a pair takes it
        slots = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_pair_ptr + slots, tl.full([CHUNK], 0, tl.int32) + P, mask=slots < n_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding is stored before any pair overwrites its slot
    earlier = tl.zeros([EXPERTS], dtype=tl.int32)  # pairs of each expert in the chunks before
    for c in range(0, P, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        expert = tl.load(index_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        onehot = (expert[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS]
        rank = tl.cumsum(onehot, axis=0) - onehot + (padded_start + earlier)[None, :]
        slot = tl.sum(onehot * rank, axis=1)  # [CHUNK]
        tl.store(sorted_pair_ptr + slot, offs, mask=offs < P)
        earlier += tl.sum(onehot, axis=0)
