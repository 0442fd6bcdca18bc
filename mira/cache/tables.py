"""Where every expert can be read now, and the tokens routed since they were last settled (DESIGN.md 2.8).

Every MoE layer computes from an address table that holds, for each of its experts, an address the
kernel can read: the expert's slot row when it is resident and its copy has landed, else its blob
in the host store (pinned on CUDA, read over PCIe inside the same launch: zero-copy, the same
bytes). Layers add their routed tokens per expert to counters on the device; the cache reads them
back and settles them with the policy, before the layer's kernel (inline residency) or once after
the step for every layer at once (lagged residency: no host sync inside the step).

This module holds the tables and counters and rewrites table entries without allocating or waiting:
the addresses are constants (one per host blob, one per slot row) kept on the device, and an entry
is rewritten by one small kernel that copies a constant into it, on the stream the caller picks.
Prefetching (mira.cache.staging) also points entries at its stage rows for the span of one step,
and keeps its per-layer state beside the counters, so one read-back serves both.

L MoE layers, E experts per layer, S slots.
"""

from __future__ import annotations

import numpy as np
import torch

from mira.cache.slots import SlotPool
from mira.store.store import ExpertStore

UID, PLACED, ISSUED, USED = range(4)  # a target layer's staging state (mira.kernels.staging; PLACED: an address)
STAGING_COLUMNS = 4
STAGING_COUNTS = slice(ISSUED, USED + 1)  # what a drain hands over and restarts


class ExpertTables:
    """Where every expert of every MoE layer can be read now, and the tokens routed since it was settled.

    Attributes:
        tables: int64 [L, E] on the device; `tables[l]` is layer l's address table for
            `TritonMoEFFN.forward_bases`: a slot row's address or the host blob's, never 0.
        entries: the same, flat [L*E] (indexed by uid).
        blob_addresses: int64 [L*E] on the device: every expert's host blob address.
        rows: L lists of E uint8 blobs, the same places as tensors, for the reference FFN. They
            change on the host at once: on CUDA the compute stream waits for a row's copy
            (`Transfer.ready`) before a kernel reads it.
        pending: int64 [L, E] on the device: tokens routed per expert since the last `drain`.
        staging: int64 [L, 4] on the device: per target layer, staging's state since the last
            `drain` (mira.kernels.staging: uid, placed row address, issued, used); zeros without
            staging.
        limits: int32 [L, E] on the device: the intermediate units [0, limit) each expert's kernel
            computes, I but for an expert cut between the device and the CPU (`cut`).

    Args:
        store: the expert store (host blobs, pinned on CUDA).
        pool: the slot pool.
        device: where the layers run.
    """

    def __init__(self, store: ExpertStore, pool: SlotPool, device: torch.device):
        L, E, S = store.num_layers, store.num_experts, pool.num_slots
        self._store = store
        self._pool = pool
        self._experts = E
        blobs = [store.blob(*divmod(uid, E)).data_ptr() for uid in range(L * E)]
        self.blob_addresses = torch.tensor(blobs, dtype=torch.int64, device=device)  # [L*E]
        self._row_addresses = torch.tensor([pool.row(s).data_ptr() for s in range(S)], dtype=torch.int64,
                                           device=device)  # [S]
        self._uids = torch.arange(L * E, device=device)  # [L*E], the index of one entry's write
        self._null = torch.zeros(1, dtype=torch.int64, device=device)  # the address of an expert another executor computes
        self.entries = self.blob_addresses.clone()  # [L*E]
        self.tables = self.entries.view(L, E)
        self.rows = [[store.blob(layer, expert) for expert in range(E)] for layer in range(L)]
        self._counters = torch.zeros(L, E + STAGING_COLUMNS, dtype=torch.int64, device=device)  # one read-back
        # where `drain` reads them, made once; page-locked on CUDA, so `send_back` need not wait
        self._read_back = torch.empty_like(self._counters, device="cpu", pin_memory=device.type == "cuda")
        self._landed = torch.cuda.Event() if device.type == "cuda" else None  # `send_back`'s copy
        self.pending = self._counters[:, :E]  # [L, E]
        self.staging = self._counters[:, E:]  # [L, 4]
        self._intermediate = store.layout.intermediate
        self.limits = torch.full((L, E), self._intermediate, dtype=torch.int32, device=device)

    def to_slot(self, uid: int, slot: int) -> None:
        """Expert `uid`'s entry becomes slot `slot`'s row, on the current stream.

        Call it on the stream that copies the expert into the slot, right after the copy: a kernel
        that reads the entry before the copy has landed still finds the host blob. One 8-byte store
        per entry (an elementwise kernel, not a byte copy), so a kernel reading the table from
        another stream meanwhile sees the old address or the new one, never a mix.
        """
        self._write(uid, self._row_addresses[slot : slot + 1])
        layer, expert = divmod(uid, self._experts)
        self.rows[layer][expert] = self._pool.row(slot)

    def to_host(self, uid: int) -> None:
        """Expert `uid`'s entry goes back to its host blob, on the current stream.

        Call it on the compute stream before anything may overwrite the slot it leaves: kernels
        enqueued after it read the host blob.
        """
        self._write(uid, self.blob_addresses[uid : uid + 1])
        layer, expert = divmod(uid, self._experts)
        self.rows[layer][expert] = self._store.blob(layer, expert)

    def hide(self, layer: int, experts: list[int]) -> None:
        """Layer `layer`'s entries of `experts` become 0 and their rows None, on the current stream:
        kernels that add zero for an absent expert (`make_moe_ffn(absent_zero=True)`) skip them while
        the CPU computes them. Only for experts read from their host blobs; `restore` undoes it."""
        for expert in experts:
            self._write(layer * self._experts + expert, self._null)
            self.rows[layer][expert] = None

    def restore(self, layer: int, experts: list[int]) -> None:
        """Undo `hide`: the entries go back to the host blobs, on the current stream (after the kernel)."""
        for expert in experts:
            self.to_host(layer * self._experts + expert)

    def cut(self, layer: int, expert: int, units: int) -> None:
        """Layer `layer`'s kernel computes only the first `units` intermediate units of `expert`, on
        the current stream (the CPU computes the rest); `uncut` undoes it after the kernel."""
        self.limits[layer, expert].fill_(units)

    def uncut(self, layer: int, expert: int) -> None:
        self.limits[layer, expert].fill_(self._intermediate)

    def drain_layer(self, layer: int) -> tuple[list[int], list[int]]:
        """Layer `layer`'s tokens routed per expert since it was last drained, [E], and its staging
        state, [4]; zero the counts (the state stays for the step's `drain`). One host sync."""
        row = self._counters[layer].tolist()
        self.pending[layer].zero_()
        return row[:self._experts], row[self._experts:]

    def drain(self, sent: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The tokens routed per expert since the last drain, int64 [L, E], and staging's state per
        target layer, [L, 4] (views of one host buffer, valid until the next drain or `send_back`);
        zero the counts and staging's issued and used.

        The one host sync of a settle: one read-back for all layers, on the current stream (the
        compute stream, after the step's kernels). With `sent`, the counts `send_back` sent instead,
        once they have landed (kernels enqueued since then are not waited for).
        """
        if sent:
            if self._landed is not None:
                self._landed.synchronize()
        else:
            self._read_back.copy_(self._counters)
            self._restart()
        rows = self._read_back.numpy()
        return rows[:, :self._experts], rows[:, self._experts:]

    def send_back(self) -> None:
        """Start a drain without waiting: the counts so far are copied to the host once the current
        stream reaches this point, and zeroed; `drain(sent=True)` hands them over."""
        self._read_back.copy_(self._counters, non_blocking=self._landed is not None)
        self._restart()
        if self._landed is not None:
            self._landed.record()

    def _restart(self) -> None:
        self.pending.zero_()
        self.staging[:, STAGING_COUNTS].zero_()  # an expert still placed keeps its uid and row (a prefill
        # call settles between a stage and its restore)

    def _write(self, uid: int, address: torch.Tensor) -> None:
        self.entries.index_copy_(0, self._uids[uid : uid + 1], address)
