"""Group-wise INT4 expert weights: the `int4` scheme's blob sections, quantization and reference
dequantization (paper IV-B; DESIGN.md 2.4).

Every matrix is cut along its input dimension into groups of GROUP weights (the last group of a row
may be shorter); a group has one bf16 scale s and, with ZERO_POINTS, one bf16 offset m:

    symmetric      w = s * (q - 8)      q in 0..15
    zero points    w = s * q + m        q in 0..15   (m: the value of code 0, a float zero point)

Two codes share a byte, the even column in the low nibble: byte j of a row holds columns 2j and
2j + 1. A blob is

    w13 uint8 [2I, H/2] | w2 uint8 [H, I/2] | scale13 bf16 [2I, H/G] | scale2 bf16 [H, I/G]
    (| offset13 bf16 [2I, H/G] | offset2 bf16 [H, I/G] with ZERO_POINTS)

Scales come from round-to-nearest with a clipping search per group: the group's range is shrunk by
each factor of SHRINK in turn and the candidate whose dequantized group (with its scale and offset
rounded to bf16, as stored) has the least squared error wins. No calibration data is needed.

The scheme stores groups of GROUP = 64 weights with zero points, chosen among groups of
32, 64 and 128, symmetric or not, by weight error and end quality on the bundled model
(`benchmarks/int4_variants.py`, results/int4-variants-tiny.json); the other variants are kept
here for that comparison, and the fused kernels read the scheme's own.

H hidden, I expert intermediate, R rows, C columns (the input dimension), G group, N = C / G groups.
"""

from __future__ import annotations

import math

import torch

GROUP = 64
ZERO_POINTS = True
SHRINK = tuple(1.0 - 0.05 * k for k in range(10))  # clipping factors tried per group: 1.0 down to 0.55
CHUNK_ELEMENTS = 1 << 20  # weights quantized at a time (bounded temporary memory)
_CODES = 15  # the largest code
_SYMMETRIC_ZERO = 8  # symmetric codes are q - 8 in -8..7


def sections(hidden: int, intermediate: int, group: int = GROUP, zero_points: bool = ZERO_POINTS
             ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each section of one expert's blob, in blob order.

    Raises:
        ValueError: an odd hidden or intermediate size (two codes share a byte).
    """
    if hidden % 2 or intermediate % 2:
        raise ValueError(f"int4 packs two weights per byte, so the hidden size ({hidden}) and the expert intermediate "
                         f"size ({intermediate}) must be even; use an int8 scheme")
    H, I = hidden, intermediate
    specs = [("w13", torch.uint8, (2 * I, H // 2)), ("w2", torch.uint8, (H, I // 2)),
             ("scale13", torch.bfloat16, (2 * I, groups(H, group))), ("scale2", torch.bfloat16, (H, groups(I, group)))]
    if zero_points:
        specs += [("offset13", torch.bfloat16, (2 * I, groups(H, group))),
                  ("offset2", torch.bfloat16, (H, groups(I, group)))]
    return specs


def groups(columns: int, group: int = GROUP) -> int:
    """Groups per row of `columns` weights (the last one may be shorter)."""
    return math.ceil(columns / group)


def quantize(w13: torch.Tensor, w2: torch.Tensor, group: int = GROUP, zero_points: bool = ZERO_POINTS
             ) -> dict[str, torch.Tensor]:
    """One expert's sections (as `sections` names them) from w13 [2I, H] and w2 [H, I]."""
    out = {}
    for name, weights in (("13", w13), ("2", w2)):
        packed, scale, offset = quantize_matrix(weights, group, zero_points)
        out[f"w{name}"], out[f"scale{name}"] = packed, scale
        if zero_points:
            out[f"offset{name}"] = offset
    return out


def quantize_matrix(weights: torch.Tensor, group: int = GROUP, zero_points: bool = ZERO_POINTS
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[R, C] weights -> packed codes uint8 [R, C/2], scales bf16 [R, N], offsets bf16 [R, N] or None,
    on the weights' device. Runs in float32, a few rows at a time."""
    R, C = weights.shape
    N = groups(C, group)
    device = weights.device  # quantized where the weights are (the CPU in `mira convert`)
    packed = torch.empty(R, C // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(R, N, dtype=torch.bfloat16, device=device)
    offset = torch.empty(R, N, dtype=torch.bfloat16, device=device) if zero_points else None
    step = max(1, CHUNK_ELEMENTS // (N * group))
    for start in range(0, R, step):
        rows = slice(start, start + step)
        codes, s, m = _quantize_rows(weights[rows].float(), group, zero_points)
        packed[rows] = pack_nibbles(codes)
        scale[rows] = s
        if zero_points:
            offset[rows] = m
    return packed, scale, offset


def _quantize_rows(w: torch.Tensor, group: int, zero_points: bool):
    """Codes uint8 [r, C], scales and offsets bf16 [r, N] (offsets None when symmetric) of float32 rows
    [r, C], each group's clipping chosen by its squared error: symmetric, the range shrunk by each
    factor of SHRINK; with zero points, both ends shrunk together, then the low end alone with the
    high end's best factor, then the high end alone with the low end's."""
    r, C = w.shape
    N = groups(C, group)
    pad = N * group - C
    if pad:  # the last group is short: pad it with its last weight, which leaves its range as it is
        w = torch.cat([w, w[:, -1:].expand(r, pad)], dim=1)
    g = w.view(r, N, group)  # [r, N, G]
    search = _ClippingSearch(g, zero_points, pad)
    for shrink in SHRINK:
        search.try_shrink(shrink, shrink)
    if zero_points:
        high = search.shrink_hi.clone()
        for shrink in SHRINK[1:]:
            search.try_shrink(shrink, high)
        low = search.shrink_lo.clone()
        for shrink in SHRINK[1:]:
            search.try_shrink(low, shrink)
    codes = _codes(g, search.scale, search.offset, search.work)
    codes = (codes if zero_points else codes + _SYMMETRIC_ZERO).view(r, N * group)[:, :C].to(torch.uint8)
    return codes, search.scale.bfloat16(), None if search.offset is None else search.offset.bfloat16()


class _ClippingSearch:
    """The best scale and offset found so far for every group of g [r, N, G] (float32, bf16-rounded)."""

    def __init__(self, g: torch.Tensor, zero_points: bool, pad: int) -> None:
        self.g, self.pad = g, pad
        if zero_points:
            self.lo, self.hi = g.amin(dim=2), g.amax(dim=2)  # [r, N]
        else:
            self.lo, self.hi = None, g.abs().amax(dim=2)
        self.work = torch.empty_like(g)
        self.error = None
        self.scale = self.offset = self.shrink_lo = self.shrink_hi = None

    def try_shrink(self, low: float | torch.Tensor, high: float | torch.Tensor) -> None:
        """Keep, per group, the candidate with the range [lo * low, hi * high] where it has less error
        (ties keep the earlier one, clipped less)."""
        s, m = _scale_offset(None if self.lo is None else self.lo * low, self.hi * high)
        _dequantized(self.g, s, m, self.work).sub_(self.g)
        if self.pad:  # the padding of a short last group is not a weight
            self.work[:, -1, self.g.shape[2] - self.pad:] = 0
        error = self.work.square_().sum(dim=2)  # [r, N]
        low = torch.as_tensor(low, device=error.device).expand_as(error)
        high = torch.as_tensor(high, device=error.device).expand_as(error)
        if self.error is None:
            self.error, self.scale, self.offset, self.shrink_lo, self.shrink_hi = error, s, m, low, high
            return
        better = error < self.error
        self.error = torch.where(better, error, self.error)
        self.scale = torch.where(better, s, self.scale)
        self.offset = None if m is None else torch.where(better, m, self.offset)
        self.shrink_lo = torch.where(better, low, self.shrink_lo)
        self.shrink_hi = torch.where(better, high, self.shrink_hi)


def _scale_offset(lo: torch.Tensor | None, hi: torch.Tensor):
    """bf16-rounded scale and offset [r, N] (float32) of groups ranging over [lo, hi] (lo None:
    symmetric, hi the largest magnitude)."""
    if lo is None:
        s = _bf16(hi / (_CODES - _SYMMETRIC_ZERO))
        return torch.where(s > 0, s, torch.ones_like(s)), None
    s = _bf16((hi - lo) / _CODES)
    return torch.where(s > 0, s, torch.ones_like(s)), _bf16(lo)


def _codes(g: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest codes of groups g [r, N, G] into `out`: 0..15 with an offset, -8..7 without."""
    if m is None:
        torch.div(g, s[..., None], out=out)
        return out.round_().clamp_(-_SYMMETRIC_ZERO, _CODES - _SYMMETRIC_ZERO)
    torch.sub(g, m[..., None], out=out)
    return out.div_(s[..., None]).round_().clamp_(0, _CODES)


def _dequantized(g: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The groups g [r, N, G] quantized with s and m and dequantized, into `out`."""
    _codes(g, s, m, out).mul_(s[..., None])
    return out if m is None else out.add_(m[..., None])


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bf16, kept in x's dtype (the values the blob will store)."""
    return x.bfloat16().to(x.dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [R, C] in 0..15 -> bytes [R, C/2], column 2j in the low nibble of byte j."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [R, C/2] -> codes uint8 [R, C] (the inverse of `pack_nibbles`)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


def dequantize_matrix(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype,
                      group: int = GROUP) -> torch.Tensor:
    """[R, C] weights in `dtype` from packed codes [R, C/2], scales [R, N] and offsets [R, N] (None:
    symmetric)."""
    codes = unpack_nibbles(packed).to(dtype)  # [R, C]
    C = codes.shape[1]
    s = scale.to(dtype).repeat_interleave(group, dim=1)[:, :C]  # [R, C]
    if offset is None:
        return (codes - _SYMMETRIC_ZERO) * s
    return codes * s + offset.to(dtype).repeat_interleave(group, dim=1)[:, :C]


def dequantize(views: dict[str, torch.Tensor], dtype: torch.dtype, group: int = GROUP
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [2I, H] and w2 [H, I] in `dtype` from the typed views of one int4 blob."""
    return tuple(dequantize_matrix(views[f"w{name}"], views[f"scale{name}"], views.get(f"offset{name}"), dtype, group)
                 for name in ("13", "2"))
