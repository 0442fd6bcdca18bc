"""Group-wise INT4 products on the CPU, straight from an `int4` blob's sections (mira.store.int4).

A block of weight rows at a time is dequantized (w = s * q + m per group) into a small float32
buffer owned by the calling thread and multiplied there by float32 activations; the block fits in
the core's cache, so the weights leave host memory once, as packed codes, and no copy of the store
is ever made. This was chosen over torch's INT4 weight-only matmul (`_weight_int4pack_mm_for_cpu`):
its packed layout differs from the blob's, so it would have to be rebuilt from the blob on every
call (a repacked copy made at load time would be a second store in host memory), which made it the
slower of the two per expert when both were timed on an AVX-512 CPU; and it takes no short last
group.

T tokens, R weight rows (outputs), C columns (the reduction), G group, N = C / G groups (rounded up).
"""

from __future__ import annotations

import threading

import torch

from mira.store import int4

BLOCK_ELEMENTS = 1 << 19  # weights dequantized at a time: 2 MiB of float32, within a core's L2


class Int4Matmul:
    """x [T, C] float32 @ W^T -> [T, R] float32 for W [R, C] stored as packed codes, group scales and
    offsets. Each thread that calls it gets its own dequantization buffer (kept between calls)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                 ) -> torch.Tensor:
        R, C = packed.shape[0], 2 * packed.shape[1]
        rows = max(1, BLOCK_ELEMENTS // C)
        codes, weights = self._buffers(min(rows, R) * C)
        out = torch.empty(x.shape[0], R, dtype=torch.float32)  # [T, R]
        for start in range(0, R, rows):
            block = slice(start, min(start + rows, R))
            n = block.stop - block.start
            w = _dequantize(packed[block], scale[block], offset[block], codes[: n * C], weights[: n * C])  # [n, C]
            torch.matmul(x, w.T, out=out[:, block])
        return out

    def _buffers(self, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's uint8 code and float32 weight buffers of at least `elements` each."""
        held = getattr(self._local, "buffers", None)
        if held is None or held[0].numel() < elements:
            held = (torch.empty(elements, dtype=torch.uint8), torch.empty(elements, dtype=torch.float32))
            self._local.buffers = held
        return held


def _dequantize(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, codes: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """Rows [n, C] float32, in `weights`, from packed codes [n, C/2] and bf16 scales and offsets [n, N]."""
    n, C = packed.shape[0], 2 * packed.shape[1]
    pairs = codes.view(n, C // 2, 2)  # column 2j in the low nibble of byte j
    torch.bitwise_and(packed, 0xF, out=pairs[..., 0])
    torch.bitwise_right_shift(packed, 4, out=pairs[..., 1])
    w = weights.view(n, C)
    w.copy_(codes.view(n, C))
    G = int4.GROUP
    full = C // G  # whole groups; a shorter last group is scaled on its own
    s, m = scale.float(), offset.float()  # [n, N]
    if full:
        grouped = w[:, : full * G].view(n, full, G)
        grouped.mul_(s[:, :full, None]).add_(m[:, :full, None])
    if C % G:
        w[:, full * G:].mul_(s[:, full:]).add_(m[:, full:])
    return w
