"""Host memory that another process can map too, and its page-locking for CUDA.

A buffer is a memfd (an anonymous file in memory) mapped shared, in pages of its own. Another
process of the same user maps the same pages through `/proc/<pid>/fd/<fd>` (`SharedHandle`): the
CPU expert process (mira.runtime.cpu_process) reads the expert store and a layer's host rows this
way, with no second copy. Page-locked in place (`page_lock`, `cudaHostRegister`), the same pages
take asynchronous copies and the kernels' reads over PCIe.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import weakref
from dataclasses import dataclass

import torch

from mira.errors import MiraError

POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # page tables filled at mapping, not by faults on first reads
_uids = itertools.count(1)
_mappings: dict[int, weakref.ref] = {}  # base address -> its mapping, while it lives


class _Mapping(mmap.mmap):
    """A shared mapping of a memfd that keeps the file open (for other processes) while it lives."""

    fd: int
    uid: int


@dataclass(frozen=True)
class SharedFile:
    """A `host_buffer`'s memory as another process opens it: `nbytes` at `path`; `uid` tells buffers
    apart whose file descriptor numbers were reused."""

    path: str
    uid: int
    nbytes: int


@dataclass(frozen=True)
class SharedPlace:
    """A contiguous tensor in the file `uid`: `offset` bytes in."""

    uid: int
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Zeroed host memory of `shape` that `shared_handle` can hand to another process; its pages are
    faulted in by whichever thread first writes them, and it is freed when the last tensor on it goes."""
    nbytes = max(1, math.prod(shape)) * dtype.itemsize
    fd = os.memfd_create("mira", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = _Mapping(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    mapping.fd, mapping.uid = fd, next(_uids)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    address = tensor.data_ptr()
    _mappings[address] = weakref.ref(mapping)
    weakref.finalize(mapping, _release, fd, address)
    return tensor.view(dtype)[:math.prod(shape)].view(shape)


def shared_place(tensor: torch.Tensor) -> tuple[SharedFile, SharedPlace]:
    """Where another process finds a contiguous tensor in a `host_buffer`.

    Raises:
        ValueError: the tensor is not contiguous, or not in memory `host_buffer` made.
    """
    if not tensor.is_contiguous():
        raise ValueError("only a contiguous tensor can be handed to another process")
    base = tensor.untyped_storage().data_ptr()
    mapping = _mappings.get(base)
    mapping = mapping() if mapping is not None else None
    if mapping is None:
        raise ValueError("this tensor is not in shareable host memory (mira.store.host_memory.host_buffer)")
    return (SharedFile(f"/proc/{os.getpid()}/fd/{mapping.fd}", mapping.uid, len(mapping)),
            SharedPlace(mapping.uid, tensor.data_ptr() - base, tuple(tensor.shape), tensor.dtype))


class SharedViews:
    """Another process's side: tensors at the places of the files it has mapped, each mapped once."""

    def __init__(self) -> None:
        self._maps: dict[int, torch.Tensor] = {}  # uid -> uint8 [nbytes]

    def __contains__(self, uid: int) -> bool:
        return uid in self._maps

    def map(self, file: SharedFile) -> None:
        if file.uid not in self._maps:
            with open(file.path, "r+b") as opened:
                mapping = mmap.mmap(opened.fileno(), file.nbytes, flags=mmap.MAP_SHARED | POPULATE)
            self._maps[file.uid] = torch.frombuffer(mapping, dtype=torch.uint8)

    def view(self, place: SharedPlace) -> torch.Tensor:
        nbytes = math.prod(place.shape) * place.dtype.itemsize
        return self._maps[place.uid][place.offset:place.offset + nbytes].view(place.dtype).view(place.shape)

    def forget(self, uids) -> None:
        """Unmap these files (their owner has let them go)."""
        for uid in uids:
            self._maps.pop(uid, None)


def page_lock(tensor: torch.Tensor, owner: object, what: str) -> None:
    """Page-lock a contiguous host tensor in place (`cudaHostRegister`), exactly its size, for
    asynchronous copies and kernels reading it over PCIe; unlocked when `owner` is collected, after
    the device has finished the work that may still read it.

    Raises:
        MiraError: CUDA could not lock it (`what` names it in the message).
    """
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0))  # 0: cudaHostRegisterDefault
    if error:
        raise MiraError(f"CUDA could not page-lock the {tensor.nbytes / 2**30:.1f} GiB {what} (cudaError {error}); "
                        f"free host memory or run with --device cpu")
    weakref.finalize(owner, _unlock, tensor)


def _unlock(tensor: torch.Tensor) -> None:
    if torch.cuda.is_initialized():  # (at interpreter exit CUDA may be gone, and the locks with it)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _release(fd: int, address: int) -> None:
    _mappings.pop(address, None)
    os.close(fd)
