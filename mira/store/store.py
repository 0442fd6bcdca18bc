"""The expert store in host memory (paper IV-B): every expert blob of the model, pinned on CUDA.

Opening a store checks it whole before anything uses it: the manifest's format version, the
sha256 of every file (expert files are hashed while they are read into memory, so this costs no
second pass) and the shape of every expert tensor. A store that fails any check is refused.

Opening is parallel: files are read and hashed by a pool of threads (file reads and sha256 of
large buffers release the GIL), and the pages of the blob buffer are first touched by the reader
that fills them. On CUDA the filled buffer is then page-locked in place (`cudaHostRegister`)
rather than allocated pinned up front: torch's pinned allocator rounds every allocation up to a
power of two (a 45 GB store would pin 64 GB) and pins serially (DESIGN.md 3: 0.7 s/GB). The
buffer is an anonymous mapping of its own, so its locked pages never overlap another registered
range. `benchmarks/store_open.py` measures both ways.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from mira.errors import MiraError
from mira.store.files import CHUNK, sha256_file
from mira.store.layout import ExpertLayout
from mira.store.manifest import Manifest
from mira.store.verify import corrupt

MAX_WORKERS = 8  # threads reading and hashing; sha256 runs at ~1.5 GB/s per core
MAX_HEADER = 1 << 20  # bytes of a layer file's safetensors header read at most (a flipped length byte
# must not make the reader allocate gigabytes)


class ExpertStore:
    """All expert blobs of one model: `data` uint8 [L, E, B] (L MoE layers, E experts, B blob bytes).

    `codes_layout` is the layout an int4 store's codes have in `data`: "tiles" as stored (what the
    GPU kernels and the reference read), or "torch" once the CPU executor has rewritten them for
    this CPU's torch INT4 matmul (mira.kernels.cpu_int4.adapt_codes)."""

    def __init__(self, path: Path, manifest: Manifest, data: torch.Tensor):
        self.path = path
        self.manifest = manifest
        self.layout: ExpertLayout = manifest.expert_layout
        self.data = data
        self.codes_layout = "tiles"
        self.num_layers, self.num_experts, _ = data.shape

    @classmethod
    def open(cls, path: Path, pin: bool = False, progress: bool = True, workers: int | None = None) -> ExpertStore:
        """Read and verify a store.

        Args:
            path: the store directory.
            pin: page-lock the blobs (for asynchronous copies to a GPU, and kernels reading them in place).
            progress: show a progress bar while reading.
            workers: threads reading and hashing files; default min(8, CPU count); 1 reads serially.

        Raises:
            MiraError: a missing, altered or truncated file, a manifest this version cannot read, or
                blobs that CUDA could not page-lock.
        """
        manifest = Manifest.read(path)
        layout = manifest.expert_layout
        expert_files = [manifest.expert_file(layer) for layer in manifest.moe_layers]
        other_files = [rel for rel in manifest.files if rel not in expert_files]
        for rel in other_files:
            if not (path / rel).is_file():
                raise corrupt(path, manifest, f"{rel} is missing")
        for rel in expert_files:
            if rel not in manifest.files:
                raise corrupt(path, manifest, f"the manifest lists no checksum for {rel}")
        data = host_buffer((len(expert_files), manifest.num_experts, layout.nbytes))  # [L, E, B]
        bytes_total = data.numel()
        with tqdm(total=bytes_total, unit="B", unit_scale=True, desc="loading experts",
                  disable=not progress or bytes_total < (256 << 20)) as bar:
            progress_bar = _SharedBar(bar)
            with ThreadPoolExecutor(workers or min(MAX_WORKERS, os.cpu_count() or 1)) as pool:
                jobs = [pool.submit(_check_file, path, manifest, rel) for rel in other_files]
                jobs += [pool.submit(_read_verified, path, manifest, rel, data[position], progress_bar)
                         for position, rel in enumerate(expert_files)]
                _wait_all(pool, jobs)
        store = cls(path, manifest, data)
        if pin:
            store.page_lock()
        return store

    def page_lock(self) -> None:
        """Page-lock the blobs in place (`cudaHostRegister`), exactly their size, for asynchronous
        copies and for kernels reading them over PCIe. They are unlocked when the store is collected,
        after the device has finished every copy that may still read them.

        Raises:
            MiraError: CUDA could not lock them.
        """
        data = self.data
        error = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.nbytes, 0))  # 0: cudaHostRegisterDefault
        if error:
            raise MiraError(f"CUDA could not page-lock the {data.nbytes / 2**30:.1f} GiB expert store {self.path} "
                            f"(cudaError {error}); free host memory or run with --device cpu")
        weakref.finalize(self, _unlock, data)

    def blob(self, layer_position: int, expert: int) -> torch.Tensor:
        """Expert `expert` of the MoE layer at `layer_position` (0-based among MoE layers): uint8 [B]."""
        return self.data[layer_position, expert]

    @property
    def blob_bytes(self) -> int:
        return self.layout.nbytes


def host_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 host memory of `shape` in pages of its own: a private anonymous mapping, unmapped when
    the last tensor on it goes, whose pages are faulted in (zeroed) by whichever thread first writes
    them. It asks for huge pages (2 MiB where Linux's transparent huge pages allow it), which a
    shared mapping would not get: streaming a blob then crosses a page every 2 MiB instead of every
    4 KiB (benchmarks/host_pages.py)."""
    nbytes = math.prod(shape)
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no flags
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(shape)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(shape)


class _SharedBar:
    """A progress bar that several reader threads advance (tqdm's counter is not atomic)."""

    def __init__(self, bar: tqdm):
        self._bar = bar
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)


def _wait_all(pool: ThreadPoolExecutor, jobs: list[Future]) -> None:
    """Wait for every job; on the first failure (in submission order) drop the jobs not started and re-raise."""
    try:
        for job in jobs:
            job.result()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise


def _unlock(data: torch.Tensor) -> None:
    if torch.cuda.is_initialized():  # (at interpreter exit CUDA may be gone, and the locks with it)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(data.data_ptr())


def _check_file(store: Path, manifest: Manifest, rel: str) -> None:
    if sha256_file(store / rel) != manifest.files[rel]:
        raise corrupt(store, manifest, f"{rel} does not match its checksum")


def _read_verified(store: Path, manifest: Manifest, rel: str, out: torch.Tensor, bar: _SharedBar) -> None:
    """Read the single uint8 tensor of a safetensors file into `out` [E, B], hashing as it goes."""
    path = store / rel
    if not path.is_file():
        raise corrupt(store, manifest, f"{rel} is missing")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        header_bytes = f.read(min(struct.unpack("<Q", head)[0], MAX_HEADER)) if len(head) == 8 else b""
        digest.update(header_bytes)
        try:
            entry = json.loads(header_bytes)["experts"]
        except (ValueError, KeyError, TypeError):
            raise corrupt(store, manifest, f"{rel} has no readable 'experts' tensor") from None
        if not isinstance(entry, dict) or entry.get("dtype") != "U8" or entry.get("shape") != list(out.shape):
            raise corrupt(store, manifest, f"{rel} does not hold the U8 {list(out.shape)} tensor the manifest says")
        view = memoryview(out.numpy()).cast("B")
        filled = 0
        while filled < len(view):
            n = f.readinto(view[filled : filled + CHUNK])
            if not n:
                raise corrupt(store, manifest, f"{rel} is truncated")
            digest.update(view[filled : filled + n])
            filled += n
            bar.update(n)
        digest.update(f.read())
    if digest.hexdigest() != manifest.files[rel]:
        raise corrupt(store, manifest, f"{rel} does not match its checksum")
