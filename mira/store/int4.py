"""Group-wise INT4 expert weights: the `int4` scheme's blob sections, quantization and reference
dequantization (paper IV-B; DESIGN.md 2.4).

Every matrix is cut along its input dimension into groups of GROUP weights; a group has one bf16
scale s and one bf16 zero z, and a weight is

    w = s * (q - 8) + z        q in 0..15   (symmetric variants store z = 0)

Codes are laid out in tiles of TILE rows, the layout of torch's INT4 weight-only matmul on an
AVX-512 CPU (`_convert_weight_to_int4pack_for_cpu`, `_weight_int4pack_mm_for_cpu`), so that the CPU
multiplies a blob in place: tile t holds rows [TILE t, TILE (t + 1)) column by column, and its byte
(c, j) holds row TILE t + j of column c in the low nibble and row TILE t + HALF + j in the high one.
On the GPU a tile's column is one 32-byte load. A blob is

    w13 uint8 [2I, H/2] | w2 uint8 [H, I/2] | sz13 bf16 [H/G, 2I, 2] | sz2 bf16 [I/G, H, 2]

(2I rows are I for ungated experts, which have up rows only; the codes' shapes are the bytes
counted per row, as torch takes them; sz holds (s, z) per group and row). Rows and columns must
be whole tiles and groups: H and I multiples of TILE (and of G).

Scales come from round-to-nearest with a clipping search per group: the group's range is shrunk by
each factor of SHRINK in turn and the candidate whose dequantized group (with its scale and zero
rounded to bf16, as stored) has the least squared error wins. No calibration data is needed.

The scheme stores groups of GROUP = 64 weights with zero points, chosen among groups of
32, 64 and 128, symmetric or not, by weight error and end quality on the bundled model
(`benchmarks/int4_variants.py`, results/int4-variants-tiny.json); the other variants are kept
here for that comparison, and the fused kernels read the scheme's own.

H hidden, I expert intermediate, R rows, C columns (the input dimension), G group, N = C / G groups.
"""

from __future__ import annotations

import torch

GROUP = 64
ZERO_POINTS = True
TILE = 64  # rows per tile of codes (torch's AVX-512 INT4 layout)
HALF = TILE // 2  # a byte's high nibble is the row this far below its low one
SHRINK = tuple(1.0 - 0.05 * k for k in range(10))  # clipping factors tried per group: 1.0 down to 0.55
CHUNK_ELEMENTS = 1 << 20  # weights quantized at a time (bounded temporary memory)
_CODES = 15  # the largest code
MID = 8  # the code whose weight is the zero z: w = s (q - MID) + z


def sections(hidden: int, intermediate: int, group: int = GROUP, gated: bool = True
             ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each section of one expert's blob, in blob order (w13 has the up rows
    only where not `gated`).

    Raises:
        ValueError: a hidden or intermediate size that is not whole tiles and groups.
    """
    H, I = hidden, intermediate
    unit = max(TILE, group)
    if H % unit or I % unit:
        raise ValueError(f"int4 stores tiles of {TILE} rows and groups of {group} weights, so the hidden size ({H}) "
                         f"and the expert intermediate size ({I}) must be multiples of {unit}; use an int8 scheme")
    rows13 = 2 * I if gated else I
    return [("w13", torch.uint8, (rows13, H // 2)), ("w2", torch.uint8, (H, I // 2)),
            ("sz13", torch.bfloat16, (H // group, rows13, 2)), ("sz2", torch.bfloat16, (I // group, H, 2))]


def quantize(w13: torch.Tensor, w2: torch.Tensor, group: int = GROUP, zero_points: bool = ZERO_POINTS
             ) -> dict[str, torch.Tensor]:
    """One expert's sections (as `sections` names them) from w13 [2I, H] (ungated: [I, H]) and w2 [H, I]."""
    out = {}
    for name, weights in (("13", w13), ("2", w2)):
        out[f"w{name}"], out[f"sz{name}"] = quantize_matrix(weights, group, zero_points)
    return out


def quantize_matrix(weights: torch.Tensor, group: int = GROUP, zero_points: bool = ZERO_POINTS
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] weights -> tiled codes uint8 [R, C/2] and group scales and zeros bf16 [N, R, 2], on the
    weights' device. Runs in float32, a few tiles of rows at a time."""
    R, C = weights.shape
    if R % TILE or C % group:
        raise ValueError(f"int4 quantizes whole tiles of {TILE} rows and groups of {group} columns, not [{R}, {C}]")
    N = C // group
    device = weights.device  # quantized where the weights are (the CPU in `mira convert`)
    packed = torch.empty(R, C // 2, dtype=torch.uint8, device=device)
    sz = torch.empty(N, R, 2, dtype=torch.bfloat16, device=device)
    step = TILE * max(1, CHUNK_ELEMENTS // (TILE * C))
    for start in range(0, R, step):
        rows = slice(start, start + step)
        codes, s, z = _quantize_rows(weights[rows].float(), group, zero_points)
        packed[rows] = pack_tiles(codes)
        sz[:, rows, 0], sz[:, rows, 1] = s.T, z.T
    return packed, sz


def _quantize_rows(w: torch.Tensor, group: int, zero_points: bool):
    """Codes uint8 [r, C] and scales and zeros bf16 [r, N] of float32 rows [r, C], each group's
    clipping chosen by its squared error: symmetric, the range shrunk by each factor of SHRINK;
    with zero points, both ends shrunk together, then the low end alone with the high end's best
    factor, then the high end alone with the low end's."""
    r, C = w.shape
    g = w.view(r, C // group, group)  # [r, N, G]
    search = _ClippingSearch(g, zero_points)
    for shrink in SHRINK:
        search.try_shrink(shrink, shrink)
    if zero_points:
        high = search.shrink_hi.clone()
        for shrink in SHRINK[1:]:
            search.try_shrink(shrink, high)
        low = search.shrink_lo.clone()
        for shrink in SHRINK[1:]:
            search.try_shrink(low, shrink)
    codes = _codes(g, search.scale, search.zero, search.work).view(r, C).to(torch.uint8)
    return codes, search.scale.bfloat16(), search.zero.bfloat16()


class _ClippingSearch:
    """The best scale and zero found so far for every group of g [r, N, G] (float32, bf16-rounded)."""

    def __init__(self, g: torch.Tensor, zero_points: bool) -> None:
        self.g = g
        if zero_points:
            self.lo, self.hi = g.amin(dim=2), g.amax(dim=2)  # [r, N]
        else:
            self.lo, self.hi = None, g.abs().amax(dim=2)
        self.work = torch.empty_like(g)
        self.error = None
        self.scale = self.zero = self.shrink_lo = self.shrink_hi = None

    def try_shrink(self, low: float | torch.Tensor, high: float | torch.Tensor) -> None:
        """Keep, per group, the candidate with the range [lo * low, hi * high] where it has less error
        (ties keep the earlier one, clipped less)."""
        s, z = _scale_zero(None if self.lo is None else self.lo * low, self.hi * high)
        _dequantized(self.g, s, z, self.work).sub_(self.g)
        error = self.work.square_().sum(dim=2)  # [r, N]
        low = torch.as_tensor(low, device=error.device).expand_as(error)
        high = torch.as_tensor(high, device=error.device).expand_as(error)
        if self.error is None:
            self.error, self.scale, self.zero, self.shrink_lo, self.shrink_hi = error, s, z, low, high
            return
        better = error < self.error
        self.error = torch.where(better, error, self.error)
        self.scale = torch.where(better, s, self.scale)
        self.zero = torch.where(better, z, self.zero)
        self.shrink_lo = torch.where(better, low, self.shrink_lo)
        self.shrink_hi = torch.where(better, high, self.shrink_hi)


def _scale_zero(lo: torch.Tensor | None, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16-rounded scale and zero [r, N] (float32) of groups ranging over [lo, hi] (lo None:
    symmetric, hi the largest magnitude, zero 0). With zero points, code 0 is lo, so the zero
    (code 8) is lo + 8 s, rounded as stored."""
    if lo is None:
        s = _bf16(hi / (_CODES - MID))
        s = torch.where(s > 0, s, torch.ones_like(s))
        return s, torch.zeros_like(s)
    s = _bf16((hi - lo) / _CODES)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return s, _bf16(lo + MID * s)


def _codes(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest codes 0..15 of groups g [r, N, G] into `out`."""
    torch.sub(g, z[..., None], out=out)
    return out.div_(s[..., None]).round_().add_(MID).clamp_(0, _CODES)


def _dequantized(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The groups g [r, N, G] quantized with s and z and dequantized, into `out`."""
    return _codes(g, s, z, out).sub_(MID).mul_(s[..., None]).add_(z[..., None])


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bf16, kept in x's dtype (the values the blob will store)."""
    return x.bfloat16().to(x.dtype)


def pack_tiles(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [R, C] in 0..15 -> tiled bytes [R, C/2]: tile t's byte (c, j) holds rows
    TILE t + j (low nibble) and TILE t + HALF + j (high nibble) of column c."""
    R, C = codes.shape
    halves = codes.view(R // TILE, 2, HALF, C)  # [tiles, low/high, j, c]
    return (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).reshape(R, C // 2)


def unpack_tiles(packed: torch.Tensor) -> torch.Tensor:
    """Tiled bytes uint8 [R, C/2] -> codes uint8 [R, C] (the inverse of `pack_tiles`)."""
    R, C = packed.shape[0], 2 * packed.shape[1]
    tiles = packed.reshape(R // TILE, C, HALF)  # [tiles, c, j]
    halves = torch.stack([tiles & 0xF, tiles >> 4], dim=1)  # [tiles, low/high, c, j]
    return halves.transpose(2, 3).reshape(R, C)


def dequantize_matrix(packed: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, C] weights in `dtype` from tiled codes [R, C/2] and group scales and zeros [N, R, 2]."""
    codes = unpack_tiles(packed).to(dtype)  # [R, C]
    group = codes.shape[1] // sz.shape[0]
    s, z = (sz[..., k].T.to(dtype).repeat_interleave(group, dim=1) for k in (0, 1))  # [R, C] each
    return (codes - MID) * s + z


def dequantize(views: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [2I, H] (ungated: [I, H]) and w2 [H, I] in `dtype` from the typed views of one int4 blob."""
    return tuple(dequantize_matrix(views[f"w{name}"], views[f"sz{name}"], dtype) for name in ("13", "2"))
