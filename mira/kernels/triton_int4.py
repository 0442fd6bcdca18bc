"""Fused INT4 expert FFN kernels in Triton: the `int4` scheme's blobs (mira.store.int4) in the launch
structure of the INT8 kernels (mira.kernels.triton_ffn; paper IV-F, DESIGN.md 2.8).

The kernels read the same address table (one int64 base per expert: a device slot row or the
expert's pinned host blob, read over PCIe: zero-copy), use the same workspaces, routed-pair
grouping and launch shapes as the INT8 ones; only the weight loads and their dequantization
differ. Codes are unpacked in registers: a byte holds columns 2j (low nibble) and 2j + 1, so the
low codes meet the even columns of the token and the high codes the odd ones. A weight is
s q + m (the scheme's zero-point form, int4.ZERO_POINTS), so a group's products sum to
s sum(q x) + m sum(x): scale and offset are applied once per group, not per weight.

decode: the two GEMV launches on the CUDA cores (gate/up with runs of row blocks, down with an
    optionally split reduction and a deterministic sum). A thread's 16-byte load is 32 adjacent
    weights of one group (groups are whole multiples of 32 weights): the thread sums their
    products, then scales that partial and adds the offset times the token's sum over the same
    32 columns.
prefill: the two grouped GEMMs; a K step stays inside one group (block_k <= GROUP), so the codes
    go into the tensor-core product as exact small integers, and each step's product is scaled
    per weight row and offset by the tokens' column sums afterwards.

Launch configurations are the INT8 ones' dataclasses (block_cols counts weights, not bytes),
stored per device in `<device>-int4.json` beside the INT8 tuning (mira.kernels.tuning;
`benchmarks/kernels_int4.py --autotune` writes it); the tensor-core GEMV variants (mma) are not
implemented for INT4.

T tokens, E experts in the layer, K routed per token, P = T*K routed pairs, H hidden,
I expert intermediate, G weights per group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from mira.kernels.triton_ffn import _ROW, TritonMoEFFN, _absent, _bias, _gated, _store_down_rows, group_by_expert
from mira.kernels.tuning import (
    TUNING_DIR, GemmConfig, GemvConfig, KernelConfig, device_key, load_config, shape_key,
)
from mira.store import int4
from mira.store.layout import ExpertLayout

CHUNK = 32  # adjacent weights (16 bytes) a decode thread sums before scaling them
CONVERSIONS = ("native", "bits", "prmt", "bits-fold", "prmt-fold")  # the GEMVs' unpackings (`_nibbles`)
CHUNK_W: tl.constexpr = tl.constexpr(CHUNK)  # the same, for the kernels


def _prmt_asm(magic: int, selectors: tuple[int, ...]) -> str:
    """Inline PTX: a 32-bit word's 4 low codes, then its 4 high codes, each byte-permuted into
    `magic` by its selector (one per byte position), as 8 fp32 outputs."""
    permutes = [f"prmt.b32 ${4 * half + k}, {codes}, mag, {selector:#06x};"
                for half, codes in enumerate(("lo4", "hi4")) for k, selector in enumerate(selectors)]
    return "\n".join(["{", ".reg .b32 lo4, hi4, mag;", f"mov.b32 mag, {magic:#010x};", "and.b32 lo4, $8, 0x0F0F0F0F;",
                      "shr.b32 hi4, $8, 4;", "and.b32 hi4, hi4, 0x0F0F0F0F;", *permutes, "}"])


# a code into the low byte of 2**23's mantissa (2**23 + q), or the third byte of 1/2's (1/2 + q/256)
PRMT_ASM: tl.constexpr = tl.constexpr(_prmt_asm(0x4B000000, (0x7650, 0x7651, 0x7652, 0x7653)))
PRMT_FOLD_ASM: tl.constexpr = tl.constexpr(_prmt_asm(0x3F000000, (0x7054, 0x7154, 0x7254, 0x7354)))


@triton.jit
def _permuted(w, ASM: tl.constexpr):
    """Bytes -> (low codes, high codes) in fp32 by the byte permutes of ASM (compiled GPUs only)."""
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[w],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


@triton.jit
def _nibbles(w, CVT: tl.constexpr):
    """uint8 bytes -> (low codes, high codes) in fp32, exactly.
    "native": the int-to-float unit; "bits": the code placed in the mantissa of 2**23 by integer
    logic, then one add; "prmt": the same with one byte-permute per code, four bytes at a time
    (inline PTX: compiled GPUs only). The "-fold" forms skip the add: they give 1/2 + q/256 (the
    code in the mantissa of 1/2), which `_chunk_dots` corrects with the group's scale and offset."""
    if CVT == "prmt":
        lo, hi = _permuted(w, PRMT_ASM)
        return lo - 8388608.0, hi - 8388608.0
    elif CVT == "prmt-fold":
        return _permuted(w, PRMT_FOLD_ASM)
    elif CVT == "bits":
        b = w.to(tl.uint32)
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return lo, hi
    elif CVT == "bits-fold":
        b = w.to(tl.uint32)
        return (((b & 15) << 16) | 0x3F000000).to(tl.float32, bitcast=True), \
            (((b >> 4) << 16) | 0x3F000000).to(tl.float32, bitcast=True)
    else:
        b = w.to(tl.int32)
        return (b & 15).to(tl.float32), (b >> 4).to(tl.float32)


@triton.jit
def _chunk_dots(w, x_even, x_odd, s, z, ROWS: tl.constexpr, BYTES: tl.constexpr, CVT: tl.constexpr):
    """Bytes w [ROWS, BYTES] against the fp32 token's even and odd columns [BYTES] -> [ROWS, BYTES / 16]:
    per chunk of 32 weights, the dequantized products summed, sum (s q + z) x = s sum q x + z sum x
    (s, z [ROWS, BYTES / 16]: each chunk's group scale and offset). With codes v = 1/2 + q/256 (the
    "-fold" conversions), sum q x = 256 sum v x - 128 sum x, so s and z become 256 s and z - 128 s."""
    lo, hi = _nibbles(w, CVT)
    p = lo * x_even[None, :] + hi * x_odd[None, :]  # [ROWS, BYTES]
    p = tl.sum(tl.reshape(p, [ROWS, BYTES // 16, 16]), axis=2)  # [ROWS, chunks]
    sx = tl.sum(tl.reshape(x_even + x_odd, [BYTES // 16, 16]), axis=1)  # the token's sum over each chunk
    if CVT == "prmt-fold" or CVT == "bits-fold":
        return p * (256.0 * s) + (z - 128.0 * s) * sx[None, :]
    return p * s + z * sx[None, :]


@triton.jit
def _gate_up_gemv4(
    hidden_ptr, stride_ht, index_ptr, bases_ptr, act_ptr,  # [T, H], [P], [E] int64, [P, I] fp32
    H, I, K, S_IN_OFF, Z_IN_OFF, B13_OFF, ROWS,
    GROUP: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
    UNROLL: tl.constexpr, EVEN_H: tl.constexpr, CVT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """Decode launch 1: program (pair, g) -> act[pair, rows] for the ROWS rows from g * ROWS."""
    pair = tl.program_id(0)
    row_start = tl.program_id(1) * ROWS
    token = pair // K
    base = tl.load(bases_ptr + tl.load(index_ptr + pair))
    present = base != 0  # an expert routed without a blob yields NaN (or zero), not a fault
    w13 = tl.multiple_of(base.to(tl.pointer_type(tl.uint8)), 16)
    s_in = tl.multiple_of((base + S_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    z_in = tl.multiple_of((base + Z_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    row_end = tl.minimum(row_start + ROWS, I)
    x_row = hidden_ptr + token * stride_ht
    for i0 in range(row_start, row_end, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        in_rows = offs_i < row_end
        row_mask = offs_i < tl.where(present, row_end, 0)  # (a scalar-bool & tensor-bool is int32 in the interpreter)
        g = _rows_dot(x_row, w13, s_in, z_in, offs_i, row_mask, H, GROUP, BLOCK_I, BLOCK_H, UNROLL, EVEN_H, CVT)
        u = _rows_dot(x_row, w13, s_in, z_in, offs_i + I, row_mask, H, GROUP, BLOCK_I, BLOCK_H, UNROLL, EVEN_H, CVT)
        g += _bias(base, B13_OFF, offs_i, row_mask, HAS_BIAS)
        u += _bias(base, B13_OFF, offs_i + I, row_mask, HAS_BIAS)
        act = _gated(g, u, present, ALPHA, LIMIT, UP_OFFSET, NAN_ABSENT)
        tl.store(act_ptr + pair * I + offs_i, act, mask=in_rows)


@triton.jit
def _rows_dot(
    x_row, w_ptr, s_ptr, z_ptr, rows, row_mask, COLS,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    UNROLL: tl.constexpr, EVEN: tl.constexpr, CVT: tl.constexpr,
):
    """[BLOCK_R] dot products of the given rows of a packed matrix ([R, COLS / 2] bytes, group
    scales and offsets [R, cdiv(COLS, GROUP)]) with the fp32-convertible vector x_row [COLS]."""
    n_groups = (COLS + GROUP - 1) // GROUP
    w_rows = w_ptr + rows[:, None] * (COLS // 2)  # [BLOCK_R, 1]
    s_rows = s_ptr + rows[:, None] * n_groups
    z_rows = z_ptr + rows[:, None] * n_groups
    acc = tl.zeros([BLOCK_R, BLOCK_C // 32], dtype=tl.float32)
    for c0 in range(0, COLS, BLOCK_C * UNROLL):
        for u in tl.static_range(UNROLL):  # unrolled: the compiler issues all the loads up front
            start = c0 + u * BLOCK_C
            offs_even = start + 2 * tl.arange(0, BLOCK_C // 2)  # the token's columns meeting the low codes
            offs_b = tl.max_contiguous(tl.multiple_of(start // 2 + tl.arange(0, BLOCK_C // 2), BLOCK_C // 2), BLOCK_C // 2)
            chunk_group = (start + tl.arange(0, BLOCK_C // 32) * CHUNK_W) // GROUP  # [chunks]
            if EVEN:
                x_even = tl.load(x_row + offs_even).to(tl.float32)
                x_odd = tl.load(x_row + offs_even + 1).to(tl.float32)
                w_mask = row_mask[:, None]
                s_mask = row_mask[:, None]
            else:
                x_even = tl.load(x_row + offs_even, mask=offs_even < COLS, other=0.0).to(tl.float32)
                x_odd = tl.load(x_row + offs_even + 1, mask=offs_even < COLS, other=0.0).to(tl.float32)
                w_mask = row_mask[:, None] & (offs_b < COLS // 2)[None, :]
                s_mask = row_mask[:, None] & (start + tl.arange(0, BLOCK_C // 32) * CHUNK_W < COLS)[None, :]
            w = tl.load(w_rows + offs_b[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
            s = tl.load(s_rows + chunk_group[None, :], mask=s_mask, other=0.0).to(tl.float32)
            z = tl.load(z_rows + chunk_group[None, :], mask=s_mask, other=0.0).to(tl.float32)
            acc += _chunk_dots(w, x_even, x_odd, s, z, BLOCK_R, BLOCK_C // 2, CVT)
    return tl.sum(acc, axis=1)


@triton.jit
def _down_gemv4(
    act_ptr, index_ptr, weights_ptr, bases_ptr, out_ptr, stride_ot,  # [P, I] fp32, [P], [P], [E], [T, H]
    partial_ptr, count_ptr,  # [T, H / BLOCK_H, SPLIT, BLOCK_H] fp32, [T, H / BLOCK_H] int32 zeros (SPLIT > 1)
    H, I, K, W2_OFF, S_OUT_OFF, Z_OUT_OFF, B2_OFF, SPAN,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    UNROLL: tl.constexpr, SPLIT: tl.constexpr, EVEN_I: tl.constexpr, CVT: tl.constexpr,
    HAS_BIAS: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """Decode launch 2: program (token, block of H rows, s) -> the token's K experts summed over
    columns [s * SPAN, (s + 1) * SPAN) of I; split sums are added by the last program of a row
    block to arrive, in split order (as the INT8 `_down_gemv`)."""
    token = tl.program_id(0)
    block = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = offs_h < H
    col_start = split * SPAN
    col_end = tl.minimum(col_start + SPAN, I)
    n_groups = (I + GROUP - 1) // GROUP
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, K):
        pair = token * K + k
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        base = tl.load(bases_ptr + tl.load(index_ptr + pair))
        present = base != 0
        w2 = tl.multiple_of((base + W2_OFF).to(tl.pointer_type(tl.uint8)), 16)
        s_out = tl.multiple_of((base + S_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
        z_out = tl.multiple_of((base + Z_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
        row_mask = offs_h < tl.where(present, H, 0)
        w_rows = w2 + offs_h[:, None] * (I // 2)  # [BLOCK_H, 1]
        s_rows = s_out + offs_h[:, None] * n_groups
        z_rows = z_out + offs_h[:, None] * n_groups
        act_row = act_ptr + pair * I
        acc = tl.zeros([BLOCK_H, BLOCK_I // 32], dtype=tl.float32)
        for i0 in range(col_start, col_end, BLOCK_I * UNROLL):
            for u in tl.static_range(UNROLL):
                start = i0 + u * BLOCK_I
                offs_even = start + 2 * tl.arange(0, BLOCK_I // 2)
                offs_b = tl.max_contiguous(tl.multiple_of(start // 2 + tl.arange(0, BLOCK_I // 2), BLOCK_I // 2), BLOCK_I // 2)
                chunk_start = start + tl.arange(0, BLOCK_I // 32) * CHUNK_W  # [chunks]
                if EVEN_I:
                    a_even = tl.load(act_row + offs_even)
                    a_odd = tl.load(act_row + offs_even + 1)
                    w_mask = row_mask[:, None]
                    s_mask = row_mask[:, None]
                else:
                    a_even = tl.load(act_row + offs_even, mask=offs_even < col_end, other=0.0)
                    a_odd = tl.load(act_row + offs_even + 1, mask=offs_even < col_end, other=0.0)
                    w_mask = row_mask[:, None] & (offs_b < col_end // 2)[None, :]
                    s_mask = row_mask[:, None] & (chunk_start < col_end)[None, :]
                w = tl.load(w_rows + offs_b[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
                s = tl.load(s_rows + (chunk_start // GROUP)[None, :], mask=s_mask, other=0.0).to(tl.float32)
                z = tl.load(z_rows + (chunk_start // GROUP)[None, :], mask=s_mask, other=0.0).to(tl.float32)
                acc += _chunk_dots(w, a_even, a_odd, s, z, BLOCK_H, BLOCK_I // 2, CVT)
        y = tl.sum(acc, axis=1) + _bias(base, B2_OFF, offs_h, offs_h < tl.where(present & (split == 0), H, 0),
                                        HAS_BIAS)  # the bias once per row: in split 0's sum
        total += _absent(y, present, NAN_ABSENT) * weight
    _store_down_rows(out_ptr + token * stride_ot + offs_h, total, in_rows, partial_ptr, count_ptr,
                     token * tl.num_programs(1) + block, split, SPLIT, BLOCK_H)


@triton.jit
def _codes_tile(w_ptrs, mask, ROWS: tl.constexpr, COLS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Bytes [ROWS, COLS / 2] at w_ptrs -> the codes [ROWS, COLS], exact in DOT_DTYPE."""
    w = tl.load(w_ptrs, mask=mask, other=0)
    lo, hi = _nibbles(w, "bits")
    return tl.reshape(tl.join(lo, hi), [ROWS, COLS]).to(DOT_DTYPE)  # byte j -> columns 2j, 2j + 1


@triton.jit
def _gate_up_gemm4(
    x_ptr, stride_xt, sorted_pair_ptr, block_expert_ptr, bases_ptr, act_ptr,  # act [P, I]
    P, H, I, K, S_IN_OFF, Z_IN_OFF, B13_OFF,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr,
    NAN_ABSENT: tl.constexpr,
):
    """Prefill launch 1: program (block of one expert's pairs, block of I rows) -> act rows. A K
    step lies in one group: its codes' product with the tokens is scaled per row afterwards."""
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert < 0:  # past the last padded block of this call
        return
    base = tl.load(bases_ptr + expert)
    present = base != 0
    w13 = tl.multiple_of(base.to(tl.pointer_type(tl.uint8)), 16)
    s_in = tl.multiple_of((base + S_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    z_in = tl.multiple_of((base + Z_IN_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    pairs = tl.load(sorted_pair_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    valid = pairs < P
    tokens = pairs // K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = offs_n < I
    row_mask = offs_n < tl.where(present, I, 0)
    n_groups = (H + GROUP - 1) // GROUP
    x_cols = x_ptr + tokens[None, :] * stride_xt  # [1, BM]
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        if EVEN_K:
            x_mask = valid[None, :]
            w_mask = row_mask[:, None]
        else:
            x_mask = valid[None, :] & (offs_k < H)[:, None]
            w_mask = row_mask[:, None] & (offs_kb < H // 2)[None, :]
        x_t = tl.load(x_cols + offs_k[:, None], mask=x_mask, other=0.0)  # [BK, BM]
        group = k0 // GROUP
        for half in tl.static_range(2):  # gate rows, then up rows
            rows = offs_n + half * I
            w_ptrs = w13 + rows[:, None] * (H // 2) + offs_kb[None, :]
            q = _codes_tile(w_ptrs, w_mask, BLOCK_N, BLOCK_K, DOT_DTYPE)  # [BN, BK]
            part = tl.dot(q, x_t.to(DOT_DTYPE), input_precision=PRECISION)  # [BN, BM]
            s = tl.load(s_in + rows * n_groups + group, mask=row_mask, other=0.0).to(tl.float32)
            part = part * s[:, None]
            z = tl.load(z_in + rows * n_groups + group, mask=row_mask, other=0.0).to(tl.float32)
            part += z[:, None] * tl.sum(x_t.to(tl.float32), axis=0)[None, :]
            if half == 0:
                acc_g += part
            else:
                acc_u += part
    if HAS_BIAS:
        acc_g += _bias(base, B13_OFF, offs_n, row_mask, HAS_BIAS)[:, None]
        acc_u += _bias(base, B13_OFF, offs_n + I, row_mask, HAS_BIAS)[:, None]
    act = _gated(acc_g, acc_u, present, ALPHA, LIMIT, UP_OFFSET, NAN_ABSENT)
    tl.store(act_ptr + pairs[None, :] * I + offs_n[:, None], act.to(act_ptr.dtype.element_ty),
             mask=valid[None, :] & in_rows[:, None])


@triton.jit
def _down_gemm4(
    act_ptr, sorted_pair_ptr, block_expert_ptr, bases_ptr, weights_ptr, y_ptr,  # act [P, I], y [P, H]
    P, H, I, W2_OFF, S_OUT_OFF, Z_OUT_OFF, B2_OFF,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, NAN_ABSENT: tl.constexpr,
):
    """Prefill launch 2: program (block of one expert's pairs, block of H rows) -> y rows,
    weighted (one row per pair; the launcher sums each token's K rows)."""
    pid_b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_b)
    if expert < 0:
        return
    base = tl.load(bases_ptr + expert)
    present = base != 0
    w2 = tl.multiple_of((base + W2_OFF).to(tl.pointer_type(tl.uint8)), 16)
    s_out = tl.multiple_of((base + S_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    z_out = tl.multiple_of((base + Z_OUT_OFF).to(tl.pointer_type(tl.bfloat16)), 8)
    pairs = tl.load(sorted_pair_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < P
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = offs_n < H
    row_mask = offs_n < tl.where(present, H, 0)
    n_groups = (I + GROUP - 1) // GROUP
    a_cols = act_ptr + pairs[None, :] * I  # [1, BM]
    w_rows = w2 + offs_n[:, None] * (I // 2)  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        if EVEN_K:
            a_mask = valid[None, :]
            w_mask = row_mask[:, None]
        else:
            a_mask = valid[None, :] & (offs_k < I)[:, None]
            w_mask = row_mask[:, None] & (offs_kb < I // 2)[None, :]
        a_t = tl.load(a_cols + offs_k[:, None], mask=a_mask, other=0.0)  # [BK, BM]
        q = _codes_tile(w_rows + offs_kb[None, :], w_mask, BLOCK_N, BLOCK_K, DOT_DTYPE)  # [BN, BK]
        part = tl.dot(q, a_t.to(DOT_DTYPE), input_precision=PRECISION)
        s = tl.load(s_out + offs_n * n_groups + k0 // GROUP, mask=row_mask, other=0.0).to(tl.float32)
        part = part * s[:, None]
        z = tl.load(z_out + offs_n * n_groups + k0 // GROUP, mask=row_mask, other=0.0).to(tl.float32)
        part += z[:, None] * tl.sum(a_t.to(tl.float32), axis=0)[None, :]
        acc += part
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += _bias(base, B2_OFF, offs_n, row_mask, HAS_BIAS)[:, None]
    y = _absent(acc * weight[None, :], present, NAN_ABSENT)
    tl.store(y_ptr + pairs[None, :] * H + offs_n[:, None], y.to(y_ptr.dtype.element_ty),
             mask=valid[None, :] & in_rows[:, None])


def tuning_name(device_name: str) -> str:
    """The name the INT4 launch configurations of a device are stored under: "NVIDIA H200" ->
    "NVIDIA H200 int4" (file `nvidia-h200-int4.json`)."""
    return f"{device_name} int4"


def default_int4_config(hidden: int, intermediate: int) -> KernelConfig:
    """An untuned configuration: rows of up to 512 weights per step, more programs for small
    experts, the integer-logic conversion (the tuning picks the byte-permute one where it is faster)."""
    rows = 16 if intermediate >= 8192 else 4
    cols = min(512, max(CHUNK, triton.next_power_of_2(hidden)))
    return KernelConfig(
        gate_up_gemv=GemvConfig(block_rows=rows, block_cols=cols, unroll=2, cvt="bits"),
        down_gemv=GemvConfig(block_rows=8, block_cols=min(1024, max(CHUNK, triton.next_power_of_2(intermediate))),
                             unroll=1, cvt="bits"),
        gemm=GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3),
    )


def load_int4_config(device_name: str, hidden: int, intermediate: int, directory: Path = TUNING_DIR) -> KernelConfig:
    """The stored INT4 configuration for this device and shape, else `default_int4_config`."""
    name = tuning_name(device_name)
    path = directory / f"{device_key(name)}.json"
    if path.exists() and shape_key(hidden, intermediate) in json.loads(path.read_text()).get("shapes", {}):
        return load_config(name, hidden, intermediate, directory)
    return default_int4_config(hidden, intermediate)


class TritonInt4MoEFFN(TritonMoEFFN):
    """The routed experts of one MoE layer from their INT4 blobs (same interface, workspaces and
    allocation rules as `TritonMoEFFN`)."""

    schemes = {"int4": _ROW}  # scales in sections named as int8-row's: scale13, scale2

    def __init__(self, layout: ExpertLayout, device: torch.device | str, *, config: KernelConfig | None = None,
                 **options) -> None:
        """
        Args:
            layout: an `int4` blob layout.
            device: where the kernels run ("cuda", "cuda:N"; "cpu" under TRITON_INTERPRET=1).
            config: launch configuration; default: the stored INT4 tuning for this device and shape.
            **options: num_experts, max_tokens, top_k, dtype, as for `TritonMoEFFN`.

        Raises:
            ValueError: not an int4 layout, or a configuration these kernels cannot run.
        """
        device = torch.device(device)
        if config is None and layout.scheme == "int4":
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            config = load_int4_config(name, layout.hidden, layout.intermediate)
        if config is not None:
            _check_config(config)
        super().__init__(layout, device, config=config, **options)
        self._z_in_off = layout.sections["offset13"].offset
        self._z_out_off = layout.sections["offset2"].offset

    def _cvt(self, gemv: GemvConfig) -> str:
        """"prmt" ("prmt-fold") unpacks 4 bytes per instruction group: it needs a multiple of 4 bytes
        per thread and compiled code; otherwise "bits" ("bits-fold")."""
        per_thread = gemv.block_rows * gemv.block_cols // 2 // (32 * gemv.num_warps)
        if gemv.cvt in ("prmt", "prmt-fold") and (self.device.type != "cuda" or per_thread % 4):
            return gemv.cvt.replace("prmt", "bits")
        return gemv.cvt

    @property
    def cut_granule(self) -> None:
        """The INT4 GEMVs do not cut experts."""
        return None

    def _decode(self, hidden, index, weights, bases, out, K, limits=None) -> None:  # limits: None (no cuts)
        T, H = hidden.shape
        I, cfg = self.layout.intermediate, self.config
        up, down = cfg.gate_up_gemv, cfg.down_gemv
        common = dict(GROUP=int4.GROUP)
        rows = self._rows_per_program(T * K, up)
        _gate_up_gemv4[(T * K, triton.cdiv(I, rows))](
            hidden, hidden.stride(0), index, bases, self._decode_act, H, I, K, self._s_in_off, self._z_in_off,
            self._b13_off, rows, BLOCK_I=up.block_rows, BLOCK_H=up.block_cols, UNROLL=up.unroll,
            EVEN_H=H % (up.block_cols * up.unroll) == 0, CVT=self._cvt(up), **common,
            num_warps=up.num_warps, num_stages=up.num_stages, **self._after_up,
        )
        span = self._down_span
        splits = triton.cdiv(I, span)
        _down_gemv4[(T, triton.cdiv(H, down.block_rows), splits)](
            self._decode_act, index, weights, bases, out, out.stride(0), self._split_partials, self._split_counts,
            H, I, K, self._w2_off, self._s_out_off, self._z_out_off, self._b2_off, span,
            BLOCK_H=down.block_rows, BLOCK_I=down.block_cols, UNROLL=down.unroll, SPLIT=splits,
            EVEN_I=splits * span == I, CVT=self._cvt(down), **common,
            num_warps=down.num_warps, num_stages=down.num_stages, **self._after_down,
        )

    def _prefill_gemm(self, hidden, index, weights, bases, out, K) -> None:
        T, H = hidden.shape
        I, g = self.layout.intermediate, self.config.gemm
        P = T * K
        block_k = min(g.block_k, int4.GROUP)  # a K step inside one group
        sorted_pair, block_expert = group_by_expert(index, bases.numel(), g.block_m)
        act, y = self._prefill_buffers(P, hidden.dtype)
        dot_dtype, precision = self._dot_types(hidden.dtype)
        n_blocks = block_expert.numel()
        common = dict(GROUP=int4.GROUP, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=block_k,
                      DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=g.num_warps,
                      num_stages=g.num_stages)
        _gate_up_gemm4[(n_blocks, triton.cdiv(I, g.block_n))](
            hidden, hidden.stride(0), sorted_pair, block_expert, bases, act, P, H, I, K, self._s_in_off,
            self._z_in_off, self._b13_off, EVEN_K=H % block_k == 0, **common, **self._after_up,
        )
        _down_gemm4[(n_blocks, triton.cdiv(H, g.block_n))](
            act, sorted_pair, block_expert, bases, weights, y, P, H, I, self._w2_off, self._s_out_off,
            self._z_out_off, self._b2_off, EVEN_K=I % block_k == 0, **common, **self._after_down,
        )
        torch.sum(y.view(T, K, H), dim=1, out=out)  # each token's K weighted expert outputs


def _check_config(config: KernelConfig) -> None:
    """Raise ValueError for a launch configuration the INT4 kernels cannot run."""
    for name, gemv in (("gate_up_gemv", config.gate_up_gemv), ("down_gemv", config.down_gemv)):
        if gemv.mma:
            raise ValueError(f"{name}: the INT4 kernels have no tensor-core GEMV (mma); use a CUDA-core configuration")
        if gemv.cvt not in CONVERSIONS:
            raise ValueError(f"{name}: cvt must be one of {', '.join(CONVERSIONS)} for INT4, not {gemv.cvt!r}")
        if gemv.block_cols % CHUNK:
            raise ValueError(f"{name}: block_cols must be a multiple of {CHUNK} weights for INT4, "
                             f"not {gemv.block_cols}")
    if int4.GROUP % CHUNK:
        raise ValueError(f"INT4 groups of {int4.GROUP} weights are not whole chunks of {CHUNK}")
