"""Fused INT4 expert FFN kernels in Triton: the `int4` scheme's blobs (mira.store.int4) in the launch
structure of the INT8 kernels (mira.kernels.triton_ffn; paper IV-F, DESIGN.md 2.8).

The kernels read the same address table (one int64 base per expert: a device slot row or the
expert's pinned host blob, read over PCIe: zero-copy), use the same workspaces, routed-pair
grouping and launch shapes as the INT8 ones; only the weight loads and their dequantization
differ. Codes come in tiles of TILE rows (torch's CPU INT4 layout): a tile's column is 32
contiguous bytes, byte j holding row j in its low nibble and row HALF + j in its high one. A code
becomes an exact fp32 by integer logic (the nibble put into the mantissa of 2**23, then one fma),
and a weight is s (q - 8) + z, so a group's products sum to s sum(q x) + (z - 8 s) sum(x): the
group's scale and zero are applied once per group and row, not per weight.

decode: two GEMV launches on the CUDA cores (`_tiles_dot`). A program owns whole tiles and walks
    their columns a step of several groups at a time: each step is LANES lanes, 4 per group, and
    per sub-step a lane reads one column of every tile (4 adjacent lanes: 128 contiguous bytes
    of a tile), GROUP / 4 sub-steps per group. A lane sums its codes times x over its columns of
    the group (one fma per code, no exchange between threads) before the group's scale and zero
    apply; the lanes are added once, at the end of the program.
    1. gate/up, grid (P, unit tiles / tiles per program): a program's gate tiles, then the up
       tiles of the same units (I / TILE tiles further), SwiGLU into the fp32 workspace act [P, I].
    2. down, grid (T, H / block_rows, K x splits): per token its K experts' tiles summed with their
       routing weights, each expert in programs of its own (`down_per_pair`; else one program walks
       the K in turn: grid (T, H / block_rows, splits)); with `split` the reduction over I is
       shared by several programs too; the last of a row block's programs to arrive adds their
       partial sums in a fixed order (`_store_down_rows`).
    Where the GPU can and both grids fit on its SMs side by side (small experts, few routed pairs:
    mira.kernels.dependent), the down launch is a dependent one: its programs start while gate/up
    runs, ask L2 for their bytes, and wait for act.
prefill: the two grouped GEMMs; a K step stays inside one group (block_k <= GROUP), so the codes
    go into the tensor-core product as exact small integers, and each step's product is scaled
    per weight row and offset by the tokens' column sums afterwards. A block of block_n rows is
    whole tiles: its rows' low codes, then their high codes.

Launch configurations are the INT8 ones' dataclasses (mira.kernels.tuning), with these meanings
for the INT4 GEMVs:
    block_rows: rows per program, whole tiles (a multiple of TILE); for gate/up, units (each with
        its gate and up row).
    block_cols: columns per step, a power of two and whole groups: LANES = block_cols / 16 lanes;
        at least 256 x num_warps keeps every thread on lanes of its own (16 lanes a warp); fewer
        share each lane's rows between threads (fewer registers a thread, more warps an SM).
    unroll: sub-steps whose loads a loop iteration issues together (a divisor of GROUP / 4).
    cvt: how codes meet x: "bits" (exact fp32 codes, `_codes`), "fold" (codes offset by 2**23
        summed as they are, one fma per code fewer: `_code_floats`) or "half2" (fp16 pairs summed
        in fp16 within a group, inline PTX: `_half2_fma`; interpreted, the same arithmetic in Triton
        operations).
    mma: not implemented; programs_per_sm and split as for INT8.
They are stored per device in `<device>-int4.json` beside the INT8 tuning
(`benchmarks/kernels_int4.py --autotune` writes it); block_n of the GEMM is whole tiles too.

T tokens, E experts in the layer, K routed per token, P = T*K routed pairs, H hidden,
I expert intermediate, G = GROUP weights per group, NT tiles of a program.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mira.kernels.dependent import await_primary, pays, prefetch_l2, release, supported_on
from mira.kernels.triton_ffn import (
    TritonMoEFFN, _absent, _bias, _down_part, _gated, _store_down_rows, group_by_expert, split_span,
)
from mira.kernels.tuning import (
    TUNING_DIR, GemmConfig, GemvConfig, KernelConfig, device_key, load_config, shape_key,
)
from mira.store import int4
from mira.store.layout import ExpertLayout

TILE, HALF, GROUP = int4.TILE, int4.HALF, int4.GROUP
LANES_PER_GROUP = 4  # adjacent columns read together: 4 x 32 bytes of a tile
SUB_STEPS = GROUP // LANES_PER_GROUP  # columns of a group each decode lane reads
CVTS = ("bits", "fold", "half2")  # the decode conversions (GemvConfig.cvt)
MAGIC = 0x4B000000  # the bits of 2**23, a kernel argument (`_codes`)
DESIGN_SMS = 132  # the H200's SMs, which the untuned configuration fills
TILE_W: tl.constexpr = tl.constexpr(TILE)  # the same, for the kernels
HALF_W: tl.constexpr = tl.constexpr(HALF)
GROUP_W: tl.constexpr = tl.constexpr(GROUP)
LPG_W: tl.constexpr = tl.constexpr(LANES_PER_GROUP)
LINES_PER_GROUP_W: tl.constexpr = tl.constexpr(GROUP * HALF // 128)  # 128-byte lines of a tile's group of codes
PREFETCH_GROUPS: tl.constexpr = tl.constexpr(8)  # groups of a down tile whose lines one prefetch step asks for
# inline PTX where the kernels compile; the interpreter runs `_half2_fma` and `_f16_pair` as the same
# f16 arithmetic in Triton operations
PTX: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _codes(w, magic, lo_unit, hi_unit):
    """uint32 words [NT, LANES, HALF / 4] of tile bytes -> (low codes, high codes) [NT, LANES, HALF] as
    exact fp32 (byte j is byte j % 4 of word j / 4). Each nibble is masked in place, at bit p (bytes
    2 and 3 of a word after one shift, so that no nibble lies above bit 19), and put into the
    mantissa of 2**23 by one mask-and-or: 2**23 + q 2**p; one fma with the units 2**-p
    (`_code_units`) then gives q. `magic` is 2**23's bits, passed at run time so that the compiler
    keeps it in a register and encodes each mask in its instruction."""
    w16 = w >> 16
    lo = tl.join(tl.join(w & 0xF, w & 0xF0000), tl.join(w & 0xF00, w16 & 0xF00))  # [.., 2, 2]: byte 2 i + j
    hi = tl.join(tl.join(w & 0xF0, w16 & 0xF0), tl.join(w & 0xF000, w16 & 0xF000))
    lo = (tl.reshape(lo, [w.shape[0], w.shape[1], 4 * w.shape[2]]) | magic).to(tl.float32, bitcast=True)
    hi = (tl.reshape(hi, [w.shape[0], w.shape[1], 4 * w.shape[2]]) | magic).to(tl.float32, bitcast=True)
    return lo * lo_unit - 8388608.0 * lo_unit, hi * hi_unit - 8388608.0 * hi_unit


@triton.jit
def _code_units(j):
    """2**-p of `_codes` for the codes of bytes j [..] (j % 4 of a word): (low nibbles at bits 0, 8,
    16, 8; high ones at bits 4, 12, 4, 12)."""
    n = j % 4
    lo = tl.where(n == 0, 1.0, tl.where(n == 2, 1.0 / 65536, 1.0 / 256))
    hi = tl.where(n % 2 == 0, 1.0 / 16, 1.0 / 4096)
    return lo, hi


@triton.jit
def _code_floats(w, magic):
    """uint32 words [NT, LANES, HALF / 4] of tile bytes -> (low, high) [NT, LANES, HALF] as the fp32
    2**23 + q 2**15 and 2**23 + q 2**19 ("fold"): each byte shifted so that its nibbles lie at bits
    15 and 19, then one mask-and-or each. Products with these are summed as they are: the sum less
    2**23 times the columns' sum is exact to about 2**-17 of it, and takes no fma per code."""
    a, b, c, d = w << 15, w << 7, w >> 1, w >> 9  # bytes 0, 1, 2, 3 at bits 15 to 22
    lo = tl.join(tl.join(a & 0x78000, c & 0x78000), tl.join(b & 0x78000, d & 0x78000))  # [.., 2, 2]: byte 2 i + j
    hi = tl.join(tl.join(a & 0x780000, c & 0x780000), tl.join(b & 0x780000, d & 0x780000))
    lo = (tl.reshape(lo, [w.shape[0], w.shape[1], 4 * w.shape[2]]) | magic).to(tl.float32, bitcast=True)
    hi = (tl.reshape(hi, [w.shape[0], w.shape[1], 4 * w.shape[2]]) | magic).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _half2_fma(w, x2, a, b, c, d, e, magic16):
    """One column's uint32 words [NT, LANES, HALF / 4] into fp16 pair sums ("half2"; inline PTX): x2
    is x 2**-8 twice as f16x2; a and b gain (q - 8) x2 of the low nibbles of bytes (0, 2) and (1, 3),
    c and d of the high ones, and e gains x2 (the column sum the zeros take). A pair of nibbles becomes
    two exact f16 by one mask-and-or with magic16 (1024's f16 bits twice, a run-time value as
    `_codes`' magic: 1024 + q or 1024 + 16 q) and one f16x2 subtract or fma: two codes for three
    instructions. Interpreted, each product and sum is taken in fp32 and rounded to f16."""
    if not PTX:
        return (_f16_fma_pair(w & 0xF, (w >> 16) & 0xF, x2, a), _f16_fma_pair((w >> 8) & 0xF, (w >> 24) & 0xF, x2, b),
                _f16_fma_pair((w >> 4) & 0xF, (w >> 20) & 0xF, x2, c), _f16_fma_pair((w >> 12) & 0xF, w >> 28, x2, d),
                _f16_twice(_f16_lo(e) + _f16_lo(x2)))
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u, k1, k2, k3;
        mov.b32 k1, 0x64086408;
        mov.b32 k2, 0x2C002C00;
        mov.b32 k3, 0xD480D480;
        shr.b32 u, $5, 8;
        and.b32 t, $5, 0x000F000F;
        or.b32 t, t, $12;
        sub.f16x2 t, t, k1;
        fma.rn.f16x2 $0, t, $6, $7;
        and.b32 t, u, 0x000F000F;
        or.b32 t, t, $12;
        sub.f16x2 t, t, k1;
        fma.rn.f16x2 $1, t, $6, $8;
        and.b32 t, $5, 0x00F000F0;
        or.b32 t, t, $12;
        fma.rn.f16x2 t, t, k2, k3;
        fma.rn.f16x2 $2, t, $6, $9;
        and.b32 t, u, 0x00F000F0;
        or.b32 t, t, $12;
        fma.rn.f16x2 t, t, k2, k3;
        fma.rn.f16x2 $3, t, $6, $10;
        add.rn.f16x2 $4, $6, $11;
        }""",
        constraints="=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r", args=[w, x2, a, b, c, d, e, tl.broadcast_to(magic16, w.shape)],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1,
    )


@triton.jit
def _f16_fma_pair(q_lo, q_hi, x2, acc):
    """f16x2 bits acc + (q - 8) x2 for codes (q_lo, q_hi) (uint32) and x2 = x twice: one
    fma.rn.f16x2 of `_half2_fma`, taken in fp32 and rounded to f16 (the interpreter's)."""
    x = _f16_lo(x2)
    return _f16_bits(_f16_lo(acc) + (q_lo.to(tl.int32) - 8).to(tl.float32) * x) \
        | (_f16_bits(_f16_hi(acc) + (q_hi.to(tl.int32) - 8).to(tl.float32) * x) << 16)


@triton.jit
def _f16_pair(x):
    """fp32 x -> x rounded to f16, twice, as the bits of an f16x2 (inline PTX: one instruction)."""
    if not PTX:
        return _f16_twice(x)
    return tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $1, $1;", constraints="=r,r", args=[x],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _f16_bits(v):
    """fp32 v rounded to f16 -> its bits in the low half of a uint32."""
    return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _f16_twice(v):
    """fp32 v rounded to f16, in both halves of f16x2 bits."""
    return _f16_bits(v) * 0x10001


@triton.jit
def _f16_lo(h):
    """The low f16 of f16x2 bits h, as fp32."""
    return (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(h):
    """The high f16 of f16x2 bits h, as fp32."""
    return (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half2_sums(a, b):
    """fp16 pair sums of bytes (0, 2) and (1, 3) [NT, LANES, HALF / 4] -> [NT, LANES, HALF] fp32 in the
    order of `_codes`."""
    return tl.reshape(tl.join(tl.join(_f16_lo(a), _f16_hi(a)), tl.join(_f16_lo(b), _f16_hi(b))),
                      [a.shape[0], a.shape[1], 4 * a.shape[2]])


@triton.jit
def _group_scales(w, BIAS: tl.constexpr):
    """Group (s, z) words of a scale section read as uint32 -> (s, z - BIAS s) in fp32: a weight is
    s (q - 8 + BIAS) + (z - BIAS s), for codes taken as q - 8 + BIAS."""
    s = (w << 16).to(tl.float32, bitcast=True)
    z = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    if BIAS == 0:  # no multiply by zero left for the compiler to keep (it cannot fold 0 s: s may be inf)
        return s, z
    return s, z - BIAS * s


@triton.jit
def _tiles_dot(x_row, codes, sz_words, tiles, R, C, group_start, group_end, magic,
               LANES: tl.constexpr, UNROLL: tl.constexpr, CVT: tl.constexpr):
    """Tiles [NT] of one matrix ([R, C] as tiled codes at `codes`, (s, z) words [C / G, R] at
    sz_words) against the vector at x_row over groups [group_start, group_end) -> (lo, hi) [NT, HALF]
    fp32: rows TILE t + j and TILE t + HALF + j of each tile t (tiles past R give rows of the last).
    A step covers LANES / 4 groups; lanes past group_end read the last group against zeros.
    CVT: how codes meet x ("bits": `_codes`; "fold": `_code_floats`; "half2": `_half2_fma`).
    magic: see `_codes`."""
    lane = tl.arange(0, LANES)
    j = tl.arange(0, HALF_W)[None, None, :]
    lo_unit, hi_unit = _code_units(j)
    tiles = tl.minimum(tiles, R // TILE_W - 1)[:, None, None]  # [NT, 1, 1]
    tile_words = codes.to(tl.pointer_type(tl.uint32)) + tiles * (HALF_W // 4 * C) \
        + tl.arange(0, HALF_W // 4)[None, None, :]  # [NT, 1, HALF / 4]
    lo_rows = tiles * TILE_W + j  # [NT, 1, HALF]
    acc_lo = tl.zeros([tiles.shape[0], LANES, HALF_W], dtype=tl.float32)
    acc_hi = tl.zeros([tiles.shape[0], LANES, HALF_W], dtype=tl.float32)
    words = tl.zeros([tiles.shape[0], LANES, HALF_W // 4], dtype=tl.uint32)  # the shape of a column's words
    magic16 = (magic + (0x64006400 - 0x4B000000)).to(tl.uint32)  # "half2": 1024 twice in f16, at run time
    for g0 in range(group_start, group_end, LANES // LPG_W):
        group = g0 + lane // LPG_W  # [LANES]
        in_cols = group < group_end
        group = tl.minimum(group, group_end - 1)
        col0 = group * GROUP_W + lane % LPG_W
        p_lo = tl.zeros([tiles.shape[0], LANES, HALF_W], dtype=tl.float32)
        p_hi = tl.zeros([tiles.shape[0], LANES, HALF_W], dtype=tl.float32)
        h_a, h_b, h_c, h_d, h_x = words, words, words, words, words  # "half2": f16 pair sums of the group (zeros)
        x_sum = tl.zeros([1, LANES, 1], dtype=tl.float32)
        x_at = x_row + col0[None, :, None]  # [1, LANES, 1]: each sub-step's loads at constant offsets from these
        x_in = in_cols[None, :, None]
        w_at = tile_words + col0[None, :, None] * (HALF_W // 4)  # [NT, LANES, HALF / 4]
        for k0 in range(0, GROUP_W // LPG_W, UNROLL):
            for u in tl.static_range(UNROLL):  # unrolled: the loads are issued together
                x = tl.load(x_at + (k0 + u) * LPG_W, mask=x_in, other=0.0).to(tl.float32)
                w = tl.load(w_at + (k0 + u) * (LPG_W * HALF_W // 4))  # [NT, LANES, HALF / 4]
                if CVT == "half2":
                    x2 = tl.broadcast_to(_f16_pair(x * 0.00390625), w.shape)
                    h_a, h_b, h_c, h_d, h_x = _half2_fma(w, x2, h_a, h_b, h_c, h_d, h_x, magic16)
                else:
                    if CVT == "fold":
                        lo, hi = _code_floats(w, magic)
                    else:
                        lo, hi = _codes(w, magic, lo_unit, hi_unit)
                    p_lo += lo * x
                    p_hi += hi * x
                    x_sum += x
        at = sz_words + group[None, :, None] * R + lo_rows
        if CVT == "half2":  # sums of (q - 8) x 2**-8: the sums stay in units of 2**-8 until the end
            x_sum = tl.max(_f16_lo(h_x), axis=2, keep_dims=True)  # [NT, LANES, 1]: each word has the column sum
            s, z = _group_scales(tl.load(at), 0)
            acc_lo += _half2_sums(h_a, h_b) * s + x_sum * z
            s, z = _group_scales(tl.load(at + HALF_W), 0)
            acc_hi += _half2_sums(h_c, h_d) * s + x_sum * z
        elif CVT == "fold":  # sums of (2**23 + q 2**15) x and (2**23 + q 2**19) x
            s, zz = _group_scales(tl.load(at), 8)
            acc_lo += (p_lo - 8388608.0 * x_sum) * (s * (1.0 / 32768)) + x_sum * zz
            s, zz = _group_scales(tl.load(at + HALF_W), 8)
            acc_hi += (p_hi - 8388608.0 * x_sum) * (s * (1.0 / 524288)) + x_sum * zz
        else:
            s, zz = _group_scales(tl.load(at), 8)
            acc_lo += p_lo * s
            acc_lo += x_sum * zz
            s, zz = _group_scales(tl.load(at + HALF_W), 8)
            acc_hi += p_hi * s
            acc_hi += x_sum * zz
    if CVT == "half2":
        return tl.sum(acc_lo, axis=1) * 256.0, tl.sum(acc_hi, axis=1) * 256.0
    return tl.sum(acc_lo, axis=1), tl.sum(acc_hi, axis=1)


@triton.jit
def _tile_rows(lo, hi):
    """(lo, hi) [NT, HALF] halves of tiles -> [NT * TILE] in row order."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [lo.shape[0] * TILE_W])


@triton.jit
def _gate_up_gemv4(
    hidden_ptr, stride_ht, index_ptr, bases_ptr, act_ptr,  # [T, H], [P], [E] int64, [P, I] fp32
    H, I, K, SZ13_OFF, B13_OFF, TILES, MAGIC,
    BLOCK_T: tl.constexpr, LANES: tl.constexpr, UNROLL: tl.constexpr, CVT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr,
    CUBIC: tl.constexpr, GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATED: tl.constexpr, NAN_ABSENT: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    """Decode launch 1: program (pair, b) -> act[pair, units] of unit tiles [b TILES, (b + 1) TILES),
    BLOCK_T at a time: their gate tiles, then their up tiles (ungated: the up tiles, rows [0, I)).
    DEPENDENT: the down launch may start once every program has begun (mira.kernels.dependent)."""
    release(DEPENDENT)
    pair = tl.program_id(0)
    tile_start = tl.program_id(1) * TILES
    tile_end = tl.minimum(tile_start + TILES, I // TILE_W)
    token = pair // K
    base = tl.load(bases_ptr + tl.load(index_ptr + pair))
    present = base != 0  # an expert routed without a blob yields NaN (or zero), not a fault
    w13 = tl.multiple_of(base.to(tl.pointer_type(tl.uint8)), 16)
    sz13 = tl.multiple_of((base + SZ13_OFF).to(tl.pointer_type(tl.uint32)), 16)
    groups = tl.where(present, H // GROUP_W, 0)  # an absent expert's loops do not run
    x_row = hidden_ptr + token * stride_ht
    unit_end = tl.where(present, tile_end * TILE_W, 0)  # the units whose biases are read
    rows13 = 2 * I if GATED else I
    for t0 in range(tile_start, tile_end, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        g_lo, g_hi = _tiles_dot(x_row, w13, sz13, tiles, rows13, H, 0, groups, MAGIC, LANES, UNROLL, CVT)
        units = tl.arange(0, BLOCK_T * TILE_W) + t0 * TILE_W
        g = _tile_rows(g_lo, g_hi) + _bias(base, B13_OFF, units, units < unit_end, HAS_BIAS)
        u = g  # unused when not GATED
        if GATED:
            u_lo, u_hi = _tiles_dot(x_row, w13, sz13, tiles + I // TILE_W, rows13, H, 0, groups, MAGIC, LANES, UNROLL,
                                    CVT)
            u = _tile_rows(u_lo, u_hi) + _bias(base, B13_OFF, units + I, units < unit_end, HAS_BIAS)
        act = _gated(g, u, present, ALPHA, LIMIT, UP_OFFSET, CUBIC, GATE_CAP, UP_CAP, GATED, NAN_ABSENT)
        tl.store(act_ptr + pair * I + units, act, mask=units < tile_end * TILE_W)


@triton.jit
def _down_gemv4(
    act_ptr, index_ptr, weights_ptr, bases_ptr, out_ptr, stride_ot,  # [P, I] fp32, [P], [P], [E], [T, H]
    partial_ptr, count_ptr,  # [T, H / BLOCK_H, PARTS, BLOCK_H] fp32, [T, H / BLOCK_H] int32 zeros (PARTS > 1)
    H, I, K, W2_OFF, SZ2_OFF, B2_OFF, SPAN, MAGIC,
    BLOCK_T: tl.constexpr, LANES: tl.constexpr, UNROLL: tl.constexpr, CVT: tl.constexpr, PARTS: tl.constexpr,
    PER_PAIR: tl.constexpr, HAS_BIAS: tl.constexpr, NAN_ABSENT: tl.constexpr, DEPENDENT: tl.constexpr,
):
    """Decode launch 2: program (token, block of BLOCK_T tiles of H rows, part) -> the token's K
    experts summed over columns [s SPAN, (s + 1) SPAN) of I, split s = part; PER_PAIR: expert k's
    alone, part = k S + s of S splits. The PARTS programs of a row block add up: the last to
    arrive adds their sums in part order (as the INT8 `_down_gemv`). DEPENDENT: a dependent launch
    (mira.kernels.dependent), whose programs ask L2 for the lines of their experts' codes and scales
    while gate/up runs, then wait for its act."""
    token = tl.program_id(0)
    block = tl.program_id(1)
    part = tl.program_id(2)
    split, k_first, k_end = _down_part(part, I, SPAN, K, PER_PAIR)
    tiles = block * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = block * BLOCK_T * TILE_W + tl.arange(0, BLOCK_T * TILE_W)
    group_start = split * (SPAN // GROUP_W)
    group_end = tl.minimum(group_start + SPAN // GROUP_W, I // GROUP_W)
    if DEPENDENT:
        for k in range(k_first, k_end):
            ahead = tl.load(bases_ptr + tl.load(index_ptr + token * K + k))
            if ahead != 0:
                blob = ahead.to(tl.pointer_type(tl.uint8))
                for t in range(0, BLOCK_T):
                    tile = tl.minimum(block * BLOCK_T + t, H // TILE_W - 1)
                    for g0 in range(group_start, group_end, PREFETCH_GROUPS):
                        codes, scales = _down_lines(tile, g0, group_end, H, I, W2_OFF, SZ2_OFF, PREFETCH_GROUPS)
                        prefetch_l2(blob + codes, DEPENDENT)
                        prefetch_l2(blob + scales, DEPENDENT)
    await_primary(DEPENDENT)
    total = tl.zeros([BLOCK_T * TILE_W], dtype=tl.float32)
    for k in range(k_first, k_end):
        pair = token * K + k
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        base = tl.load(bases_ptr + tl.load(index_ptr + pair))
        present = base != 0
        w2 = tl.multiple_of((base + W2_OFF).to(tl.pointer_type(tl.uint8)), 16)
        sz2 = tl.multiple_of((base + SZ2_OFF).to(tl.pointer_type(tl.uint32)), 16)
        lo, hi = _tiles_dot(act_ptr + pair * I, w2, sz2, tiles, H, I, group_start,
                            tl.where(present, group_end, group_start), MAGIC, LANES, UNROLL, CVT)
        y = _tile_rows(lo, hi)
        y += _bias(base, B2_OFF, rows, rows < tl.where(present & (split == 0), H, 0), HAS_BIAS)  # once: split 0's
        total += _absent(y, present, NAN_ABSENT) * weight
    _store_down_rows(out_ptr + token * stride_ot + rows, total, rows < H, partial_ptr, count_ptr,
                     token * tl.num_programs(1) + block, part, PARTS, BLOCK_T * TILE_W)


@triton.jit
def _down_lines(tile, g0, group_end, H, I, W2_OFF, SZ2_OFF, GROUPS: tl.constexpr):
    """Blob offsets of 128-byte lines the down GEMV reads for one tile of H rows over groups
    [g0, min(g0 + GROUPS, group_end)) of I: (codes [GROUPS * 16], scales [GROUPS * 2]); offsets
    past group_end repeat the last group's."""
    c = tl.arange(0, GROUPS * LINES_PER_GROUP_W)
    g = tl.minimum(g0 + c // LINES_PER_GROUP_W, group_end - 1).to(tl.int64)
    codes = W2_OFF + tile.to(tl.int64) * (HALF_W * I) + g * (GROUP_W * HALF_W) + c % LINES_PER_GROUP_W * 128
    s = tl.arange(0, GROUPS * 2)  # a group's (s, z) words of a tile's rows: 64 x 4 bytes
    g = tl.minimum(g0 + s // 2, group_end - 1).to(tl.int64)
    scales = SZ2_OFF + (g * H + tile * TILE_W) * 4 + s % 2 * 128
    return codes, scales


@triton.jit
def _block_rows(n0, BLOCK_N: tl.constexpr):
    """The rows a GEMM block from row n0 (whole tiles) holds, in its order: the tiles' low rows,
    then their high rows -> [BLOCK_N]."""
    i = tl.arange(0, BLOCK_N)
    c = i % (BLOCK_N // 2)
    return n0 + c // HALF_W * TILE_W + i // (BLOCK_N // 2) * HALF_W + c % HALF_W


@triton.jit
def _block_codes(codes, n0, row_end, k0, C, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """Codes [BLOCK_N, BLOCK_K] of the rows `_block_rows(n0)` below row_end at columns [k0, k0 +
    BLOCK_K) of a tiled matrix of C columns, exact in DOT_DTYPE (zero past row_end)."""
    c = tl.arange(0, BLOCK_N // 2)
    tile = n0 // TILE_W + c // HALF_W  # [BN / 2]: the tile of each byte row, and its j
    k = k0 + tl.arange(0, BLOCK_K)
    b = tl.load(codes + (tile * (HALF_W * C) + c % HALF_W)[:, None] + k[None, :] * HALF_W,
                mask=(tile * TILE_W < row_end)[:, None], other=0)  # [BN / 2, BK]
    q = tl.join(b & 0xF, b >> 4)  # [BN / 2, BK, 2]: the low and the high row of each byte
    return tl.reshape(tl.permute(q, (2, 0, 1)), [BLOCK_N, BLOCK_K]).to(DOT_DTYPE)


@triton.jit
def _gate_up_gemm4(
    x_ptr, stride_xt, sorted_pair_ptr, block_expert_ptr, bases_ptr, act_ptr,  # act [P, I]
    P, H, I, K, SZ13_OFF, B13_OFF,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, CUBIC: tl.constexpr,
    GATE_CAP: tl.constexpr, UP_CAP: tl.constexpr, GATED: tl.constexpr, NAN_ABSENT: tl.constexpr,
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
    sz13 = tl.multiple_of((base + SZ13_OFF).to(tl.pointer_type(tl.uint32)), 16)
    pairs = tl.load(sorted_pair_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    valid = pairs < P
    tokens = pairs // K
    n0 = tl.program_id(1) * BLOCK_N
    rows = _block_rows(n0, BLOCK_N)  # [BN] units
    in_rows = rows < I
    row_mask = rows < tl.where(present, I, 0)
    x_cols = x_ptr + tokens[None, :] * stride_xt  # [1, BM]
    rows13 = 2 * I if GATED else I
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        x_t = tl.load(x_cols + offs_k[:, None], mask=valid[None, :], other=0.0)  # [BK, BM]
        x_sum = tl.sum(x_t.to(tl.float32), axis=0)[None, :]  # [1, BM]: the step's columns, once for both halves
        x_t = x_t.to(DOT_DTYPE)
        group = k0 // GROUP_W
        for half in tl.static_range(2 if GATED else 1):  # gate rows, then up rows (ungated: up rows only)
            q = _block_codes(w13, n0 + half * I, tl.where(present, (half + 1) * I, 0), k0, H, BLOCK_N, BLOCK_K,
                             DOT_DTYPE)  # [BN, BK]
            part = tl.dot(q, x_t, input_precision=PRECISION)  # [BN, BM]
            s, zz = _group_scales(tl.load(sz13 + group * rows13 + rows + half * I, mask=row_mask, other=0), 8)
            if half == 0:  # two fmas per element
                acc_g = acc_g + part * s[:, None] + zz[:, None] * x_sum
            else:
                acc_u = acc_u + part * s[:, None] + zz[:, None] * x_sum
    if HAS_BIAS:
        acc_g += _bias(base, B13_OFF, rows, row_mask, HAS_BIAS)[:, None]
        if GATED:
            acc_u += _bias(base, B13_OFF, rows + I, row_mask, HAS_BIAS)[:, None]
    act = _gated(acc_g, acc_u, present, ALPHA, LIMIT, UP_OFFSET, CUBIC, GATE_CAP, UP_CAP, GATED, NAN_ABSENT)
    tl.store(act_ptr + pairs[None, :] * I + rows[:, None], act.to(act_ptr.dtype.element_ty),
             mask=valid[None, :] & in_rows[:, None])


@triton.jit
def _down_gemm4(
    act_ptr, sorted_pair_ptr, block_expert_ptr, bases_ptr, weights_ptr, y_ptr,  # act [P, I], y [P, H]
    P, H, I, W2_OFF, SZ2_OFF, B2_OFF,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, NAN_ABSENT: tl.constexpr,
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
    sz2 = tl.multiple_of((base + SZ2_OFF).to(tl.pointer_type(tl.uint32)), 16)
    pairs = tl.load(sorted_pair_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < P
    n0 = tl.program_id(1) * BLOCK_N
    rows = _block_rows(n0, BLOCK_N)  # [BN]
    in_rows = rows < H
    row_mask = rows < tl.where(present, H, 0)
    a_cols = act_ptr + pairs[None, :] * I  # [1, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        a_t = tl.load(a_cols + offs_k[:, None], mask=valid[None, :], other=0.0)  # [BK, BM]
        q = _block_codes(w2, n0, tl.where(present, H, 0), k0, I, BLOCK_N, BLOCK_K, DOT_DTYPE)  # [BN, BK]
        part = tl.dot(q, a_t.to(DOT_DTYPE), input_precision=PRECISION)
        s, zz = _group_scales(tl.load(sz2 + k0 // GROUP_W * H + rows, mask=row_mask, other=0), 8)
        acc = acc + part * s[:, None] + zz[:, None] * tl.sum(a_t.to(tl.float32), axis=0)[None, :]  # two fmas
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += _bias(base, B2_OFF, rows, row_mask, HAS_BIAS)[:, None]
    y = _absent(acc * weight[None, :], present, NAN_ABSENT)
    tl.store(y_ptr + pairs[None, :] * H + rows[:, None], y.to(y_ptr.dtype.element_ty),
             mask=valid[None, :] & in_rows[:, None])


def tuning_name(device_name: str) -> str:
    """The name the INT4 launch configurations of a device are stored under: "NVIDIA H200" ->
    "NVIDIA H200 int4" (file `nvidia-h200-int4.json`)."""
    return f"{device_name} int4"


def default_int4_config(hidden: int, intermediate: int) -> KernelConfig:
    """An untuned configuration after what the H100's and H200's autotunes chose: one tile (of units
    or of H rows) a program, "half2" codes; gate/up takes a row of up to 2048 columns in one step
    (short rows come with small experts: few programs, each sending out all its loads at once),
    longer ones in steps of 1024 on 4 warps (many programs, more of them on an SM); down steps
    of up to 1024, the reduction split so that a token's down launch has about 4 programs per SM
    (Mixtral's H has only 64 tiles)."""
    up = _gemv(hidden, widest=2048 if hidden <= 2048 else 1024)
    down = _gemv(intermediate, widest=1024)
    steps = triton.cdiv(intermediate, down.block_cols)
    split = max(1, min(steps, triton.cdiv(4 * DESIGN_SMS, hidden // TILE)))
    return KernelConfig(gate_up_gemv=up, down_gemv=dataclasses.replace(down, split=split),
                        gemm=GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3))


def _gemv(columns: int, widest: int) -> GemvConfig:
    """Steps of a row's `columns` up to `widest` (at least 256) on a warp per 256 of them."""
    block_cols = min(widest, max(256, triton.next_power_of_2(columns)))
    return decode_gemv(block_cols, block_cols // 256)


def decode_gemv(block_cols: int, num_warps: int, split: int = 1) -> GemvConfig:
    """A decode launch as the untuned configuration has them: one tile a program, steps of block_cols
    columns on num_warps warps, all 16 sub-steps of a group issued together, "half2" codes."""
    return GemvConfig(block_rows=TILE, block_cols=block_cols, unroll=SUB_STEPS, num_warps=num_warps, cvt="half2",
                      split=split)


def load_int4_config(device_name: str, hidden: int, intermediate: int, directory: Path = TUNING_DIR) -> KernelConfig:
    """The stored INT4 configuration for this device and shape, else `default_int4_config`."""
    name = tuning_name(device_name)
    path = directory / f"{device_key(name)}.json"
    if path.exists() and shape_key(hidden, intermediate) in json.loads(path.read_text()).get("shapes", {}):
        return load_config(name, hidden, intermediate, directory)
    return default_int4_config(hidden, intermediate)


class DecodeLaunches(NamedTuple):
    """A decode's two launches: unit tiles a gate/up program owns, both grids, and whether the down
    launch is a dependent one (mira.kernels.dependent)."""

    tiles: int
    gate_up_grid: tuple[int, int]
    down_grid: tuple[int, int, int]
    dependent: bool


class TritonInt4MoEFFN(TritonMoEFFN):
    """The routed experts of one MoE layer from their INT4 blobs (same interface, workspaces and
    allocation rules as `TritonMoEFFN`)."""

    schemes = {"int4": None}  # one scheme, whose scales are the sz sections

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dependent = self.config.dependent_launch and supported_on(self.device)

    def _stored_config(self, device_name: str, hidden: int, intermediate: int) -> KernelConfig:
        """The stored INT4 tuning of this device and shape, else `default_int4_config`."""
        return load_int4_config(device_name, hidden, intermediate)

    def _validate(self, config: KernelConfig) -> None:
        _check_config(config, self.layout)

    def _scale_offsets(self, sections: dict) -> tuple[int, int]:
        """The (s, z) sections of w13 and of w2."""
        return sections["sz13"].offset, sections["sz2"].offset

    def _down_split(self, intermediate: int, down: GemvConfig) -> tuple[int, int]:
        """Spans of whole steps of block_cols (here unroll counts sub-steps inside a group)."""
        return split_span(intermediate, dataclasses.replace(down, unroll=1))

    @property
    def cut_granule(self) -> None:
        """The INT4 GEMVs do not cut experts."""
        return None

    def decode_launches(self, tokens: int, top_k: int) -> DecodeLaunches:
        """The decode's launches for this many tokens and routed experts each."""
        I, H, cfg = self.layout.intermediate, self.layout.hidden, self.config
        tiles = self._rows_per_program(tokens * top_k, cfg.gate_up_gemv) // TILE
        up = (tokens * top_k, triton.cdiv(I // TILE, tiles))
        parts = triton.cdiv(I, self._down_span) * (top_k if cfg.down_per_pair else 1)
        down = (tokens, triton.cdiv(H, cfg.down_gemv.block_rows), parts)
        return DecodeLaunches(tiles, up, down, self._dependent and pays(math.prod(up), math.prod(down), self._sms))

    def _decode(self, hidden, index, weights, bases, out, K, limits=None) -> None:  # limits: None (no cuts)
        T, H = hidden.shape
        I, cfg = self.layout.intermediate, self.config
        up, down = cfg.gate_up_gemv, cfg.down_gemv
        tiles, up_grid, down_grid, dependent = self.decode_launches(T, K)
        _gate_up_gemv4[up_grid](
            hidden, hidden.stride(0), index, bases, self._decode_act, H, I, K, self._s_in_off, self._b13_off, tiles,
            MAGIC, BLOCK_T=up.block_rows // TILE, LANES=_lanes(up), UNROLL=up.unroll, CVT=up.cvt,
            num_warps=up.num_warps, num_stages=up.num_stages, **self._after_up, DEPENDENT=dependent,
        )
        _down_gemv4[down_grid](
            self._decode_act, index, weights, bases, out, out.stride(0), self._split_partials, self._split_counts,
            H, I, K, self._w2_off, self._s_out_off, self._b2_off, self._down_span, MAGIC,
            BLOCK_T=down.block_rows // TILE, LANES=_lanes(down), UNROLL=down.unroll, CVT=down.cvt, PARTS=down_grid[2],
            PER_PAIR=cfg.down_per_pair, num_warps=down.num_warps, num_stages=down.num_stages, **self._after_down,
            DEPENDENT=dependent,
            **({"launch_pdl": True} if dependent else {}),
        )

    def _prefill_gemm(self, hidden, index, weights, bases, out, K) -> None:
        T, H = hidden.shape
        I, g = self.layout.intermediate, self.config.gemm
        P = T * K
        sorted_pair, block_expert = group_by_expert(index, bases.numel(), g.block_m)
        act, y = self._prefill_buffers(P, hidden.dtype)
        dot_dtype, precision = self._dot_types(hidden.dtype)
        n_blocks = block_expert.numel()
        common = dict(BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=min(g.block_k, GROUP), DOT_DTYPE=dot_dtype,
                      PRECISION=precision, num_warps=g.num_warps, num_stages=g.num_stages)
        _gate_up_gemm4[(n_blocks, triton.cdiv(I, g.block_n))](
            hidden, hidden.stride(0), sorted_pair, block_expert, bases, act, P, H, I, K, self._s_in_off,
            self._b13_off, **common, **self._after_up,
        )
        _down_gemm4[(n_blocks, triton.cdiv(H, g.block_n))](
            act, sorted_pair, block_expert, bases, weights, y, P, H, I, self._w2_off, self._s_out_off, self._b2_off,
            **common, **self._after_down,
        )
        torch.sum(y.view(T, K, H), dim=1, out=out)  # each token's K weighted expert outputs


def _lanes(gemv: GemvConfig) -> int:
    """Decode lanes of a GEMV launch: 4 per group of a step's block_cols columns."""
    return gemv.block_cols // GROUP * LANES_PER_GROUP


def _check_config(config: KernelConfig, layout: ExpertLayout) -> None:
    """Raise ValueError for a launch configuration the INT4 kernels cannot run."""
    for name, gemv in (("gate_up_gemv", config.gate_up_gemv), ("down_gemv", config.down_gemv)):
        if gemv.mma:
            raise ValueError(f"{name}: the INT4 kernels have no tensor-core GEMV (mma); use a CUDA-core configuration")
        if gemv.cvt not in CVTS:
            raise ValueError(f"{name}: the INT4 GEMVs convert codes as one of {', '.join(CVTS)}, "
                             f"not {gemv.cvt!r}")
        if gemv.block_rows < TILE or gemv.block_rows % TILE or gemv.block_rows & (gemv.block_rows - 1):
            raise ValueError(f"{name}: block_rows must be whole tiles of {TILE} rows, a power of two, "
                             f"not {gemv.block_rows}; use {TILE} or {2 * TILE}")
        if gemv.block_cols < GROUP or gemv.block_cols & (gemv.block_cols - 1):
            raise ValueError(f"{name}: block_cols must be whole groups of {GROUP} columns, a power of two, "
                             f"not {gemv.block_cols}; use {256 * gemv.num_warps} for {gemv.num_warps} warps")
        if gemv.unroll < 1 or SUB_STEPS % gemv.unroll:
            raise ValueError(f"{name}: unroll must divide the {SUB_STEPS} sub-steps of a group, not {gemv.unroll}")
    gemm = config.gemm
    if gemm.block_n < TILE or gemm.block_n % TILE or gemm.block_n & (gemm.block_n - 1):
        raise ValueError(f"gemm: block_n must be whole tiles of {TILE} rows, a power of two, not {gemm.block_n}; "
                         f"use {2 * TILE}")
    if gemm.block_k < 16 or gemm.block_k & (gemm.block_k - 1):
        raise ValueError(f"gemm: block_k must be a power of two of at least 16 (the tensor-core K), not {gemm.block_k}")
