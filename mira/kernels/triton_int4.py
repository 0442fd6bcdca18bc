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
    32 columns. The "-dot" conversions read the rows as 32-bit words of 8 codes against a vector
    prepared once per call (the tokens in fp32 with their sums over 32-column chunks; the act
    rows' chunk sums): a word's codes go into 1/2's mantissa by byte permutes and its 8 products
    into one chain of fmas, and the chunk sums come from that vector instead of the loop.
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
CONVERSIONS = ("native", "bits", "prmt", "bits-fold", "prmt-fold", "bits-dot", "prmt-dot")  # the GEMVs' unpackings
DOT_CONVERSIONS = ("bits-dot", "prmt-dot")  # word by word against a prepared token (`_words_step`)
CHUNK_W: tl.constexpr = tl.constexpr(CHUNK)  # the same, for the kernels
SUMS_BLOCK = 1024  # columns per program of `_chunk_sums`


def _split_codes(magic: int, word: str) -> list[str]:
    """PTX lines: the low codes of the 32-bit `word`'s 4 bytes into lo4, the high codes into hi4
    (one per byte), the magic word into mag."""
    return [".reg .b32 lo4, hi4, mag;", f"mov.b32 mag, {magic:#010x};", f"and.b32 lo4, {word}, 0x0F0F0F0F;",
            f"shr.b32 hi4, {word}, 4;", "and.b32 hi4, hi4, 0x0F0F0F0F;"]


def _prmt_asm(magic: int, selectors: tuple[int, ...]) -> str:
    """Inline PTX: a 32-bit word's 4 low codes, then its 4 high codes, each byte-permuted into
    `magic` by its selector (one per byte position), as 8 fp32 outputs."""
    permutes = [f"prmt.b32 ${4 * half + k}, {codes}, mag, {selector:#06x};"
                for half, codes in enumerate(("lo4", "hi4")) for k, selector in enumerate(selectors)]
    return "\n".join(["{", *_split_codes(magic, "$8"), *permutes, "}"])


def _prmt_dot_asm(magic: int, selectors: tuple[int, ...]) -> str:
    """Inline PTX: a 32-bit word's 8 codes in column order (nibble k of the word is column k: the
    low, then the high code of each byte) byte-permuted into `magic`, times the 8 fp32 values
    $2..$9 and summed (one mul, seven fmas), as one fp32 output."""
    permutes = [f"prmt.b32 v{k}, {('lo4', 'hi4')[k % 2]}, mag, {selectors[k // 2]:#06x};" for k in range(8)]
    products = ["mul.f32 $0, v0, $2;", *(f"fma.rn.f32 $0, v{k}, ${k + 2}, $0;" for k in range(1, 8))]
    return "\n".join(["{", *_split_codes(magic, "$1"), ".reg .f32 v<8>;", *permutes, *products, "}"])


# a code into the low byte of 2**23's mantissa (2**23 + q), or the third byte of 1/2's (1/2 + q/256)
FOLD_MAGIC, FOLD_SELECTORS = 0x3F000000, (0x7054, 0x7154, 0x7254, 0x7354)
PRMT_ASM: tl.constexpr = tl.constexpr(_prmt_asm(0x4B000000, (0x7650, 0x7651, 0x7652, 0x7653)))
PRMT_FOLD_ASM: tl.constexpr = tl.constexpr(_prmt_asm(FOLD_MAGIC, FOLD_SELECTORS))
PRMT_DOT_ASM: tl.constexpr = tl.constexpr(_prmt_dot_asm(FOLD_MAGIC, FOLD_SELECTORS))


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
def _bytes_step(w_rows, x_row, s_rows, z_rows, start, end, row_mask,
                GROUP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, EVEN: tl.constexpr,
                CVT: tl.constexpr):
    """One loop step of the byte conversions: columns [start, start + COLS) (masked at `end`
    unless EVEN) of the rows at w_rows (bytes) against the vector at x_row -> [ROWS, COLS / 32]
    folded chunk dots (`_chunk_dots`)."""
    offs_even = start + 2 * tl.arange(0, COLS // 2)  # the vector's columns meeting the low codes
    offs_b = tl.max_contiguous(tl.multiple_of(start // 2 + tl.arange(0, COLS // 2), COLS // 2), COLS // 2)
    chunk_start = start + tl.arange(0, COLS // 32) * CHUNK_W  # [chunks]
    if EVEN:
        x_even = tl.load(x_row + offs_even).to(tl.float32)
        x_odd = tl.load(x_row + offs_even + 1).to(tl.float32)
        w_mask = row_mask[:, None]
        s_mask = row_mask[:, None]
    else:
        x_even = tl.load(x_row + offs_even, mask=offs_even < end, other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + offs_even + 1, mask=offs_even < end, other=0.0).to(tl.float32)
        w_mask = row_mask[:, None] & (offs_b < end // 2)[None, :]
        s_mask = row_mask[:, None] & (chunk_start < end)[None, :]
    w = tl.load(w_rows + offs_b[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
    s = tl.load(s_rows + (chunk_start // GROUP)[None, :], mask=s_mask, other=0.0).to(tl.float32)
    z = tl.load(z_rows + (chunk_start // GROUP)[None, :], mask=s_mask, other=0.0).to(tl.float32)
    return _chunk_dots(w, x_even, x_odd, s, z, ROWS, COLS // 2, CVT)


@triton.jit
def _word_columns(x):
    """The vector's values [WORDS, 8] (word j's columns 8j .. 8j + 7) -> 8 tensors [1, WORDS], the
    k-th holding column 8j + k of every word."""
    WORDS: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, [1, WORDS, 4, 2]))  # columns 2i and 2i + 1 of each word
    c04, c26 = tl.split(tl.reshape(even, [1, WORDS, 2, 2]))
    c15, c37 = tl.split(tl.reshape(odd, [1, WORDS, 2, 2]))
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _word_dots(w, x, CVT: tl.constexpr):
    """uint32 words w [ROWS, WORDS] of 8 codes (nibble k of word j: column 8j + k) against the
    vector's values x [WORDS, 8] -> [ROWS, WORDS], each word's sum of v x with its codes as
    v = 1/2 + q/256. "prmt-dot": byte permutes and one chain of fmas per word (inline PTX:
    compiled GPUs only); "bits-dot": the same values by integer logic (the interpreter's form)."""
    c = _word_columns(x)
    if CVT == "prmt-dot":
        return tl.inline_asm_elementwise(asm=PRMT_DOT_ASM, constraints="=f,r,f,f,f,f,f,f,f,f",
                                         args=[w, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]],
                                         dtype=tl.float32, is_pure=True, pack=1)
    d = tl.zeros(w.shape, dtype=tl.float32)
    for k in tl.static_range(8):
        v = ((((w >> (4 * k)) & 15) << 16) | 0x3F000000).to(tl.float32, bitcast=True)
        d += v * c[k]
    return d


@triton.jit
def _words_step(w_words, x_row, sums_row, s_rows, z_rows, start, end, row_mask,
                GROUP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, EVEN: tl.constexpr,
                CVT: tl.constexpr):
    """One loop step of the "-dot" conversions: columns [start, start + COLS) (masked at `end`
    unless EVEN) of the rows at w_words (uint32 words) against the prepared vector (fp32 values at
    x_row, sums over 32-column chunks at sums_row) -> [ROWS, COLS / 32], each chunk's dequantized
    products summed, folded as in `_chunk_dots`: sum (s q + z) x = s (256 sum v x - 128 sum x) + z sum x."""
    WORDS: tl.constexpr = COLS // 8
    words = tl.max_contiguous(tl.multiple_of(start // 8 + tl.arange(0, WORDS), WORDS), WORDS)
    cols = 8 * words[:, None] + tl.arange(0, 8)[None, :]  # [WORDS, 8]
    chunks = start // CHUNK_W + tl.arange(0, COLS // CHUNK_W)
    if EVEN:
        w_mask = row_mask[:, None]
        s_mask = row_mask[:, None]
        x = tl.load(x_row + cols)
        sx = tl.load(sums_row + chunks)
    else:
        w_mask = row_mask[:, None] & (words < end // 8)[None, :]
        s_mask = row_mask[:, None] & (chunks * CHUNK_W < end)[None, :]
        x = tl.load(x_row + cols, mask=cols < end, other=0.0)  # zero past the end: the masked codes meet zeros
        sx = tl.load(sums_row + chunks, mask=chunks * CHUNK_W < end, other=0.0)
    w = tl.load(w_words + words[None, :], mask=w_mask, other=0, eviction_policy="evict_first")
    s = tl.load(s_rows + (chunks * CHUNK_W // GROUP)[None, :], mask=s_mask, other=0.0).to(tl.float32)
    z = tl.load(z_rows + (chunks * CHUNK_W // GROUP)[None, :], mask=s_mask, other=0.0).to(tl.float32)
    d = _word_dots(w, x, CVT)  # [ROWS, WORDS]
    d = tl.sum(tl.reshape(d, [ROWS, COLS // CHUNK_W, CHUNK_W // 8]), axis=2)  # [ROWS, chunks]
    return s * (256.0 * d - 128.0 * sx[None, :]) + z * sx[None, :]


@triton.jit
def _gate_up_gemv4(
    hidden_ptr, stride_ht, index_ptr, bases_ptr, act_ptr,  # [T, H], [P], [E] int64, [P, I] fp32
    sums_ptr,  # [T, cdiv(H, 32)] fp32: the token's chunk sums (read by the "-dot" conversions only)
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
    sums_row = sums_ptr + token * ((H + CHUNK_W - 1) // CHUNK_W)
    for i0 in range(row_start, row_end, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        in_rows = offs_i < row_end
        row_mask = offs_i < tl.where(present, row_end, 0)  # (a scalar-bool & tensor-bool is int32 in the interpreter)
        g = _rows_dot(x_row, sums_row, w13, s_in, z_in, offs_i, row_mask, H, 0, H, GROUP, BLOCK_I, BLOCK_H, UNROLL,
                      EVEN_H, CVT)
        u = _rows_dot(x_row, sums_row, w13, s_in, z_in, offs_i + I, row_mask, H, 0, H, GROUP, BLOCK_I, BLOCK_H, UNROLL,
                      EVEN_H, CVT)
        g += _bias(base, B13_OFF, offs_i, row_mask, HAS_BIAS)
        u += _bias(base, B13_OFF, offs_i + I, row_mask, HAS_BIAS)
        act = _gated(g, u, present, ALPHA, LIMIT, UP_OFFSET, NAN_ABSENT)
        tl.store(act_ptr + pair * I + offs_i, act, mask=in_rows)


@triton.jit
def _rows_dot(
    x_row, sums_row, w_ptr, s_ptr, z_ptr, rows, row_mask, COLS, col_start, col_end,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    UNROLL: tl.constexpr, EVEN: tl.constexpr, CVT: tl.constexpr,
):
    """[BLOCK_R] dot products over columns [col_start, col_end) of the given rows of a packed
    matrix ([R, COLS / 2] bytes, group scales and offsets [R, cdiv(COLS, GROUP)]) with the
    fp32-convertible vector x_row [COLS] (fp32, with its chunk sums at sums_row, for the "-dot"
    conversions). The range is whole loop steps of BLOCK_C x UNROLL columns but for a last one
    masked at col_end (EVEN: none)."""
    n_groups = (COLS + GROUP - 1) // GROUP
    if CVT == "prmt-dot" or CVT == "bits-dot":
        w_rows = _row_words(w_ptr, rows, COLS, EVEN)
    else:
        w_rows = w_ptr + rows[:, None] * (COLS // 2)  # [BLOCK_R, 1]
    s_rows = s_ptr + rows[:, None] * n_groups
    z_rows = z_ptr + rows[:, None] * n_groups
    acc = tl.zeros([BLOCK_R, BLOCK_C // 32], dtype=tl.float32)
    for c0 in range(col_start, col_end, BLOCK_C * UNROLL):
        for u in tl.static_range(UNROLL):  # unrolled: the compiler issues all the loads up front
            start = c0 + u * BLOCK_C
            if CVT == "prmt-dot" or CVT == "bits-dot":
                acc += _words_step(w_rows, x_row, sums_row, s_rows, z_rows, start, col_end, row_mask,
                                   GROUP, BLOCK_R, BLOCK_C, EVEN, CVT)
            else:
                acc += _bytes_step(w_rows, x_row, s_rows, z_rows, start, col_end, row_mask,
                                   GROUP, BLOCK_R, BLOCK_C, EVEN, CVT)
    return tl.sum(acc, axis=1)


@triton.jit
def _row_words(w_ptr, rows, COLS, EVEN: tl.constexpr):
    """uint32 pointers [len(rows), 1] to the given rows of a packed matrix of COLS columns (a
    multiple of 8: whole words per row). With EVEN (COLS a multiple of 32) every row starts on 16
    bytes, which the compiler is told so that the word loads can be 16-byte vectors."""
    row_words = COLS // 8
    if EVEN:
        row_words = tl.multiple_of(row_words, 4)
    return w_ptr.to(tl.pointer_type(tl.uint32)) + rows[:, None] * row_words


@triton.jit
def _down_gemv4(
    act_ptr, index_ptr, weights_ptr, bases_ptr, out_ptr, stride_ot,  # [P, I] fp32, [P], [P], [E], [T, H]
    partial_ptr, count_ptr,  # [T, H / BLOCK_H, SPLIT, BLOCK_H] fp32, [T, H / BLOCK_H] int32 zeros (SPLIT > 1)
    sums_ptr,  # [P, cdiv(I, 32)] fp32: the act rows' chunk sums (read by the "-dot" conversions only)
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
        act_row = act_ptr + pair * I
        sums_row = sums_ptr + pair * ((I + CHUNK_W - 1) // CHUNK_W)
        y = _rows_dot(act_row, sums_row, w2, s_out, z_out, offs_h, row_mask, I, col_start, col_end, GROUP, BLOCK_H,
                      BLOCK_I, UNROLL, EVEN_I, CVT)
        y += _bias(base, B2_OFF, offs_h, offs_h < tl.where(present & (split == 0), H, 0),
                   HAS_BIAS)  # the bias once per row: in split 0's sum
        total += _absent(y, present, NAN_ABSENT) * weight
    _store_down_rows(out_ptr + token * stride_ot + offs_h, total, in_rows, partial_ptr, count_ptr,
                     token * tl.num_programs(1) + block, split, SPLIT, BLOCK_H)


@triton.jit
def _chunk_sums(x_ptr, stride_x, copy_ptr, sums_ptr, N, COPY: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, b) -> the sums of row `row` of x [rows, N] over the 32-column chunks of its
    columns [b * BLOCK, (b + 1) * BLOCK), into sums [rows, cdiv(N, 32)] fp32, and with COPY those
    columns in fp32 into copy [rows, N]: the prepared vectors of the "-dot" conversions."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=0.0).to(tl.float32)
    if COPY:
        tl.store(copy_ptr + row * N + offs, x, mask=offs < N)
    n_chunks = (N + CHUNK_W - 1) // CHUNK_W
    chunks = tl.program_id(1) * (BLOCK // CHUNK_W) + tl.arange(0, BLOCK // CHUNK_W)
    tl.store(sums_ptr + row * n_chunks + chunks, tl.sum(tl.reshape(x, [BLOCK // CHUNK_W, CHUNK_W]), axis=1),
             mask=chunks < n_chunks)


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
        x_sum = tl.sum(x_t.to(tl.float32), axis=0)[None, :]  # [1, BM]: the step's columns, once for both halves
        x_t = x_t.to(DOT_DTYPE)
        group = k0 // GROUP
        for half in tl.static_range(2):  # gate rows, then up rows
            rows = offs_n + half * I
            w_ptrs = w13 + rows[:, None] * (H // 2) + offs_kb[None, :]
            q = _codes_tile(w_ptrs, w_mask, BLOCK_N, BLOCK_K, DOT_DTYPE)  # [BN, BK]
            part = tl.dot(q, x_t, input_precision=PRECISION)  # [BN, BM]
            s = tl.load(s_in + rows * n_groups + group, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_in + rows * n_groups + group, mask=row_mask, other=0.0).to(tl.float32)[:, None]
            if half == 0:  # two fmas per element
                acc_g = acc_g + part * s + z * x_sum
            else:
                acc_u = acc_u + part * s + z * x_sum
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
        s = tl.load(s_out + offs_n * n_groups + k0 // GROUP, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_out + offs_n * n_groups + k0 // GROUP, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        acc = acc + part * s + z * tl.sum(a_t.to(tl.float32), axis=0)[None, :]  # two fmas per element
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
            _check_config(config, layout)
        super().__init__(layout, device, config=config, **options)
        self._z_in_off = layout.sections["offset13"].offset
        self._z_out_off = layout.sections["offset2"].offset
        # the "-dot" conversions' prepared vectors: the tokens in fp32 (when they come in another
        # dtype) with their sums over 32-column chunks; the act rows' chunk sums
        H, I, pairs = layout.hidden, layout.intermediate, self.config.decode_max_pairs
        dot_up, dot_down = (gemv.cvt in DOT_CONVERSIONS for gemv in (self.config.gate_up_gemv, self.config.down_gemv))
        self._x_copy = torch.empty(pairs if dot_up else 0, H, dtype=torch.float32, device=self.device)
        self._x_sums = torch.empty(pairs if dot_up else 0, triton.cdiv(H, CHUNK), dtype=torch.float32,
                                   device=self.device)
        self._act_sums = torch.empty(pairs if dot_down else 0, triton.cdiv(I, CHUNK), dtype=torch.float32,
                                     device=self.device)

    def workspace_bytes(self, tokens: int, top_k: int, dtype: torch.dtype) -> int:
        """Device bytes of the workspaces one call of this size uses (for the memory budget)."""
        prepared = self._x_copy.numel() + self._x_sums.numel() + self._act_sums.numel()
        return super().workspace_bytes(tokens, top_k, dtype) + 4 * prepared

    def _cvt(self, gemv: GemvConfig) -> str:
        """"prmt" ("prmt-fold") unpacks 4 bytes per instruction group: it needs a multiple of 4 bytes
        per thread and compiled code; otherwise "bits" ("bits-fold"). "prmt-dot" takes whole 32-bit
        words: it needs compiled code only ("bits-dot" in the interpreter)."""
        per_thread = gemv.block_rows * gemv.block_cols // 2 // (32 * gemv.num_warps)
        whole_words = gemv.cvt == "prmt-dot" or per_thread % 4 == 0
        if gemv.cvt.startswith("prmt") and (self.device.type != "cuda" or not whole_words):
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
        up_cvt, down_cvt = self._cvt(up), self._cvt(down)
        common = dict(GROUP=int4.GROUP)
        x = hidden  # [T, H]
        if up_cvt in DOT_CONVERSIONS:  # each token prepared once for its K pairs
            x = hidden if hidden.dtype == torch.float32 else self._x_copy[:T]
            _chunk_sums[(T, triton.cdiv(H, SUMS_BLOCK))](hidden, hidden.stride(0), x, self._x_sums, H,
                                                          COPY=x is not hidden, BLOCK=SUMS_BLOCK)
        rows = self._rows_per_program(T * K, up)
        _gate_up_gemv4[(T * K, triton.cdiv(I, rows))](
            x, x.stride(0), index, bases, self._decode_act, self._x_sums, H, I, K, self._s_in_off, self._z_in_off,
            self._b13_off, rows, BLOCK_I=up.block_rows, BLOCK_H=up.block_cols, UNROLL=up.unroll,
            EVEN_H=H % (up.block_cols * up.unroll) == 0, CVT=up_cvt, **common,
            num_warps=up.num_warps, num_stages=up.num_stages, **self._after_up,
        )
        if down_cvt in DOT_CONVERSIONS:  # the act rows are fp32 already: their chunk sums only
            _chunk_sums[(T * K, triton.cdiv(I, SUMS_BLOCK))](self._decode_act, I, self._decode_act, self._act_sums, I,
                                                              COPY=False, BLOCK=SUMS_BLOCK)
        span = self._down_span
        splits = triton.cdiv(I, span)
        _down_gemv4[(T, triton.cdiv(H, down.block_rows), splits)](
            self._decode_act, index, weights, bases, out, out.stride(0), self._split_partials, self._split_counts,
            self._act_sums, H, I, K, self._w2_off, self._s_out_off, self._z_out_off, self._b2_off, span,
            BLOCK_H=down.block_rows, BLOCK_I=down.block_cols, UNROLL=down.unroll, SPLIT=splits,
            EVEN_I=splits * span == I, CVT=down_cvt, **common,
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


def _check_config(config: KernelConfig, layout: ExpertLayout) -> None:
    """Raise ValueError for a launch configuration the INT4 kernels cannot run on this layout."""
    for name, gemv, row in (("gate_up_gemv", config.gate_up_gemv, layout.hidden),
                            ("down_gemv", config.down_gemv, layout.intermediate)):
        if gemv.mma:
            raise ValueError(f"{name}: the INT4 kernels have no tensor-core GEMV (mma); use a CUDA-core configuration")
        if gemv.cvt not in CONVERSIONS:
            raise ValueError(f"{name}: cvt must be one of {', '.join(CONVERSIONS)} for INT4, not {gemv.cvt!r}")
        if gemv.block_cols % CHUNK:
            raise ValueError(f"{name}: block_cols must be a multiple of {CHUNK} weights for INT4, "
                             f"not {gemv.block_cols}")
        if gemv.cvt in DOT_CONVERSIONS and row % 8:
            raise ValueError(f"{name}: cvt {gemv.cvt!r} reads rows as 32-bit words of 8 weights, and these rows "
                             f"have {row}; use {gemv.cvt.replace('dot', 'fold')!r}")
    if int4.GROUP % CHUNK:
        raise ValueError(f"INT4 groups of {int4.GROUP} weights are not whole chunks of {CHUNK}")
