"""Staging an expert chosen on the device, without the host (mira.cache.staging; DESIGN.md 2.8).

A layer's predictor picks the expert to stage for the layer two on as a device tensor; the host
never learns which. These kernels act on that choice by address, through the flat entry table of
mira.cache.tables (one int64 address per expert uid: its slot row, or its host blob) and the fixed
table of host blob addresses:

1. `stage_copy`: if the chosen expert's entry is still its host blob (it has no slot), copy the
   blob into a stage row: every program copies one chunk, reading the pinned host store over
   PCIe; otherwise copy nothing.
2. `stage_commit` (one program, after the copy): under the same condition point the entry at the
   stage row, and record in the target layer's state: the uid, the row's address if placed (else
   0), one more copy issued.
3. `stage_restore` (one program, after the target layer's kernel): if an expert was placed, point
   its entry back at its host blob unless something else has rewritten it since (an admission of
   the same expert landing late on the demand stream writes its slot row), count it used when its
   layer routed a token to it, and clear the placed address.

Each entry is written by one 8-byte store, so a kernel reading the table meanwhile sees the old
address or the new one, and all of them hold the expert's bytes. The state of a target layer is 4
int64: [uid, placed row address or 0, issued, used]. The PyTorch reference of these kernels is the CPU path of
`mira.cache.staging.DeviceStaging`, which does the same on tensors; tests/kernels/test_staging.py
runs both on the same tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_BLOCK = 16384  # bytes per program of stage_copy


@triton.jit
def _stage_copy(expert_ptr, entries_ptr, blobs_ptr, dst_ptr, first_uid, NBYTES, BLOCK: tl.constexpr):
    uid = first_uid + tl.load(expert_ptr)
    blob = tl.load(blobs_ptr + uid)
    unplaced = tl.load(entries_ptr + uid) == blob
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(unplaced, NBYTES, 0)  # a slot: no load is issued (a scalar-bool & tensor-bool
    # is int32 in the interpreter)
    src = tl.multiple_of(blob.to(tl.pointer_type(tl.uint8)), 16)
    data = tl.load(src + offs, mask=mask, eviction_policy="evict_first")
    tl.store(dst_ptr + offs, data, mask=mask)


@triton.jit
def _stage_commit(expert_ptr, entries_ptr, blobs_ptr, state_ptr, first_uid, row_address):
    uid = first_uid + tl.load(expert_ptr)
    entry = tl.load(entries_ptr + uid)
    placed = entry == tl.load(blobs_ptr + uid)
    tl.store(entries_ptr + uid, tl.where(placed, row_address, entry))
    tl.store(state_ptr + 0, uid)
    tl.store(state_ptr + 1, tl.where(placed, row_address, 0))
    tl.store(state_ptr + 2, tl.load(state_ptr + 2) + placed.to(tl.int64))


@triton.jit
def _stage_restore(entries_ptr, blobs_ptr, state_ptr, pending_ptr, first_uid):
    uid = tl.load(state_ptr + 0)
    placed = tl.load(state_ptr + 1)
    if placed != 0:
        entry = tl.load(entries_ptr + uid)
        tl.store(entries_ptr + uid, tl.where(entry == placed, tl.load(blobs_ptr + uid), entry))
        routed = tl.load(pending_ptr + (uid - first_uid)) > 0
        tl.store(state_ptr + 3, tl.load(state_ptr + 3) + routed.to(tl.int64))
        tl.store(state_ptr + 1, 0)


def stage_copy(expert: torch.Tensor, entries: torch.Tensor, blobs: torch.Tensor, dst: torch.Tensor,
               first_uid: int) -> None:
    """Copy expert `first_uid + expert[0]`'s host blob into `dst` (uint8 [B]) if its entry is its blob."""
    nbytes = dst.numel()
    _stage_copy[(triton.cdiv(nbytes, COPY_BLOCK),)](expert, entries, blobs, dst, first_uid, nbytes, BLOCK=COPY_BLOCK)


def stage_commit(expert: torch.Tensor, entries: torch.Tensor, blobs: torch.Tensor, state: torch.Tensor,
                 first_uid: int, row_address: int) -> None:
    """After `stage_copy`: point the expert's entry at `row_address` if it was its blob; `state` [4]."""
    _stage_commit[(1,)](expert, entries, blobs, state, first_uid, row_address)


def stage_restore(entries: torch.Tensor, blobs: torch.Tensor, state: torch.Tensor, pending: torch.Tensor,
                  first_uid: int) -> None:
    """After the target layer's kernel: the placed expert's entry back to its blob, used counted."""
    _stage_restore[(1,)](entries, blobs, state, pending, first_uid)
