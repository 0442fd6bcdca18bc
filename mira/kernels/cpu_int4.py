"""Group-wise INT4 products on the CPU, straight from an `int4` blob's sections (mira.store.int4).

The blob's codes are laid out as torch's INT4 weight-only matmul takes them on an AVX-512 CPU, so
`torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, G, sz)` multiplies a blob in place: bf16
activations, codes converted in registers, no copy of the store. Torch picks its layout by the
vector width of the CPU it runs on (tiles of 64 rows with AVX-512, narrower ones without), so
`torch_reads_blobs` packs a probe once and compares. Where the layouts differ, a CPU-only run
rewrites the store's codes once, in host memory, into torch's layout (`adapt_codes`: the same bytes
reordered, so still no second copy), as no GPU kernel reads them there; with 256-bit vectors that
is a shuffle of nibbles between the bytes of each tile (`halved_tiles`). Where the GPU reads the
tiles too (the CPU's share of a hybrid run), `Int4Matmul` dequantizes a few tiles of rows at a time
into a float32 buffer of the calling thread (it fits in the core's cache, so the weights still
leave host memory once, as codes) and multiplies there, an order of magnitude slower.

T tokens, R weight rows (outputs), C columns (the reduction), G group, N = C / G groups.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from mira.store import int4

COMPUTE_DTYPE = torch.bfloat16  # activations of torch's INT4 product (its scales are the blob's bf16)
BLOCK_ELEMENTS = 1 << 19  # weights dequantized at a time by the fallback: 2 MiB of float32, within L2
ADAPT_ELEMENTS = 1 << 22  # codes rewritten at a time by a thread of `adapt_codes` (bounds its temporaries)
QUIET_BYTES = 256 << 20  # a store smaller than this is rewritten without a progress bar (as it is read)


@functools.cache
def torch_reads_blobs() -> bool:
    """Whether torch's INT4 matmul on this CPU takes the blob's tiled codes as they are."""
    probe = _probe()
    return probe is not None and torch.equal(*probe)


@functools.cache
def adapts_codes() -> bool:
    """Whether a CPU-only run lays an int4 store's codes out for torch here (`adapt_codes`): torch
    packs them into as many bytes as the tiles, in another order."""
    probe = _probe()
    return probe is not None and probe[0].shape == probe[1].shape and not torch.equal(*probe)


def _probe() -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes of two tiles and two groups, as tiles and as torch packs them on this CPU; None where
    torch has no INT4 packing for the CPU."""
    if getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None) is None:
        return None
    rows, cols = 2 * int4.TILE, 2 * int4.GROUP
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    tiles = int4.pack_tiles(((r * 7 + c * 3 + r // 5) % 16).to(torch.uint8))  # every row and column differs
    return tiles, _torch_packed(tiles)


class Int4Matmul:
    """x [T, C] @ W^T -> [T, R] (in x's dtype) for W [R, C] stored as tiled codes [R, C/2] and group
    scales and zeros [N, R, 2].

    Args:
        fast: use torch's INT4 matmul (default: where `torch_reads_blobs` says it reads the blob).
    """

    def __init__(self, fast: bool | None = None) -> None:
        self.fast = torch_reads_blobs() if fast is None else fast
        self._local = threading.local()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        if self.fast:
            group = 2 * packed.shape[1] // sz.shape[0]
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(COMPUTE_DTYPE).contiguous(), packed, group, sz)
            return y.to(x.dtype)
        return self._dequantized_product(x.float(), packed, sz).to(x.dtype)

    def _dequantized_product(self, x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """The fallback: a few tiles of rows at a time, dequantized into this thread's buffer."""
        R, C = packed.shape[0], 2 * packed.shape[1]
        rows = int4.TILE * max(1, BLOCK_ELEMENTS // (int4.TILE * C))
        weights = self._buffer(min(rows, R) * C)
        out = torch.empty(x.shape[0], R, dtype=torch.float32)  # [T, R]
        for start in range(0, R, rows):
            block = slice(start, min(start + rows, R))
            w = _dequantize(packed[block], sz[:, block], weights[: (block.stop - start) * C])  # [n, C]
            torch.matmul(x, w.T, out=out[:, block])
        return out

    def _buffer(self, elements: int) -> torch.Tensor:
        """This thread's float32 weight buffer of at least `elements`."""
        held = getattr(self._local, "weights", None)
        if held is None or held.numel() < elements:
            held = torch.empty(elements, dtype=torch.float32)
            self._local.weights = held
        return held


def adapt_codes(store, progress: bool = False) -> None:
    """Rewrite, in place, the codes of every blob of an int4 `store` (mira.store.store.ExpertStore)
    from the stored tiles into the layout torch's INT4 matmul takes on this CPU, once
    (`store.codes_layout` says which the blobs hold). The files are not touched, and the bytes
    keep their count, so nothing is copied; only a product that reads this layout may read them.
    Experts are rewritten by one thread per torch thread (torch's own conversion runs on one core),
    each a few tiles of rows at a time (ADAPT_ELEMENTS codes)."""
    if store.codes_layout == "torch":
        return
    layout = store.layout

    def adapt(blob: torch.Tensor) -> None:
        views = layout.views(blob)
        for name in ("w13", "w2"):
            packed = views[name]  # [R, C/2]
            step = int4.TILE * max(1, ADAPT_ELEMENTS // (int4.TILE * 2 * packed.shape[1]))
            for start in range(0, packed.shape[0], step):
                rows = packed[start:start + step]
                rows.copy_(torch_layout(rows))

    blobs = store.data.view(-1, store.data.shape[-1])  # [L x E, B]
    bar = tqdm(total=len(blobs), desc="laying int4 codes out for this CPU", unit="expert",
               disable=not progress or store.data.nbytes < QUIET_BYTES)
    with ThreadPoolExecutor(torch.get_num_threads()) as pool, bar:
        for _ in pool.map(adapt, blobs):
            bar.update()
    store.codes_layout = "torch"


def torch_layout(packed: torch.Tensor) -> torch.Tensor:
    """Tiled codes [R, C/2] in the layout torch's INT4 matmul takes on this CPU (a new tensor of the
    same shape, where `adapts_codes`). Whole tiles of rows convert on their own: the rows of a part
    are that part's rows of the whole. Where torch's tiles are half the blob's (256-bit vectors),
    bytes are shuffled; elsewhere torch converts the unpacked codes."""
    if _halves_tiles():
        return halved_tiles(packed)
    torch_packed = _torch_packed(packed)
    if torch_packed.shape != packed.shape or torch_packed.dtype != packed.dtype:
        raise RuntimeError(f"torch packs INT4 weights [{packed.shape[0]}, {2 * packed.shape[1]}] into "
                           f"{torch_packed.dtype} {tuple(torch_packed.shape)}, not the blob's {tuple(packed.shape)}")
    return torch_packed


def halved_tiles(packed: torch.Tensor) -> torch.Tensor:
    """Tiled codes [R, C/2] as tiles of HALF rows, whose byte (c, j) holds rows j and j + HALF / 2 of
    the tile: each tile of TILE rows becomes two, from its bytes j and j + HALF / 2 of each column."""
    R, C = packed.shape[0], 2 * packed.shape[1]
    tiles = packed.view(R // int4.TILE, C, 2, int4.HALF // 2)  # [tiles, c, first/second, j]
    first, second = tiles[:, :, 0], tiles[:, :, 1]  # rows j, j + HALF (first) and j + HALF / 2, j + 3 HALF / 2
    low = (first & 0xF) | (second << 4)  # rows j and j + HALF / 2
    high = (first >> 4) | (second & 0xF0)  # rows HALF + j and HALF + HALF / 2 + j
    return torch.stack([low, high], dim=1).view(R, C // 2)  # [tiles, low/high, c, j]


@functools.cache
def _halves_tiles() -> bool:
    """Whether torch's INT4 layout on this CPU is `halved_tiles` of the blob's."""
    probe = _probe()
    return probe is not None and torch.equal(halved_tiles(probe[0]), probe[1])


def _torch_packed(packed: torch.Tensor) -> torch.Tensor:
    """Tiled codes [R, C/2] packed by torch for its INT4 matmul on this CPU."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4.unpack_tiles(packed).to(torch.int32), 2)


def _dequantize(packed: torch.Tensor, sz: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rows [n, C] float32, in `weights`, from tiled codes [n, C/2] and scales and zeros [N, n, 2]."""
    n, C = packed.shape[0], 2 * packed.shape[1]
    N = sz.shape[0]
    w = weights.view(n, N, C // N)
    w.view(n, C).copy_(int4.unpack_tiles(packed))
    s, z = (sz[..., k].T.float()[..., None] for k in (0, 1))  # [n, N, 1] each
    return w.sub_(int4.MID).mul_(s).add_(z).view(n, C)
