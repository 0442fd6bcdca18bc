"""Prefetching: staging decided and carried out on the device, two layers ahead (paper IV-E).

The predictor's best expert for layer i+2 stays a device tensor and kernels on the prefetch stream
act on it by address (mira.kernels.staging): if it has no slot, its blob is copied into one of
three stage rows kept apart from the policy's slots, and its entry in the address table
(mira.cache.tables) points at the row once the copy has landed; layer i+2's kernel reads it from
HBM then, or from the host if the copy is late. After layer i+2 the entry goes back to the host
blob. Per MoE layer i, with C the compute stream and P the prefetch stream:

    C: count routing, predict layer i+2's expert    P (after C so far): restore layer i-1's entry;
    C: layer i's kernel                                 stage layer i+2's expert into row (i+2) % 3

Row (i+2) % 3 last held layer i-1's expert, whose kernel has run and whose entry P restored just
before. The last layer restores its own entry and C waits for P, so a step ends with every entry
back on its host blob or slot: the policy never sees a stage row. Nothing syncs with the host,
allocates, or depends on a host value that changes between steps, so a step with staging is
captured and replayed like any step without.

Each target layer keeps its state as 4 int64 (mira.kernels.staging: uid, placed row address,
issued, used) beside its routed-token counters, so one read-back returns both. On the CPU there
are no streams and the same steps run at once, in PyTorch on the same tables, also keeping the
tables' list of rows for the reference FFN: the reference of the kernels.

L MoE layers, E experts per layer, B bytes per blob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mira.cache.config import STAGING_ROWS as ROWS
from mira.cache.tables import ISSUED, PLACED, UID, USED, ExpertTables
from mira.cache.transfer import Transfer
from mira.store.store import ExpertStore


@dataclass
class PrefetchCounts:
    issued: int = 0  # copies ahead of use into a stage row
    used: int = 0  # staged and then routed at its target layer (the rest were wasted)
    admitted: int = 0  # staged, routed, and then admitted into a slot by the policy: copied once more

    def as_dict(self) -> dict[str, int]:
        return {"issued": self.issued, "used": self.used, "wasted": self.issued - self.used, "admitted": self.admitted}


class DeviceStaging:
    """Stages one predicted expert per MoE layer, two layers ahead, with no host in the loop.

    Args:
        residency: the address tables and counters; `residency.staging` holds the states.
        store: the expert store (host blobs).
        rows: ROWS device rows of B bytes each, kept from the slot pool for staging only.
        transfer: the transfer layer (its prefetch stream).
    """

    def __init__(self, residency: ExpertTables, store: ExpertStore, rows: list[torch.Tensor], transfer: Transfer):
        if len(rows) != ROWS:
            raise ValueError(f"staging needs {ROWS} rows, got {len(rows)}")
        self._residency = residency
        self._store = store
        self._rows = rows
        self._row_addresses = [row.data_ptr() for row in rows]
        self._experts = store.num_experts
        self._layers = store.num_layers
        self._cuda = transfer.device.type == "cuda"
        if self._cuda:
            from mira.kernels import staging as kernels

            self._kernels = kernels
            self._stream = transfer.prefetch_stream
            self._compute_done = torch.cuda.Event()
            self._staged = [torch.cuda.Event() for _ in range(ROWS)]  # row r: its last stage_commit

    def before_layer(self, layer: int, expert: torch.Tensor | None) -> None:
        """Layer `layer` is about to compute: restore layer-1's staged entry and stage `expert`
        (int64 [1] on the device, or None) for layer+2. Call it on the compute stream after the
        layer has counted its routing and predicted, before its kernel."""
        if layer == 0 and expert is None:
            return
        if not self._cuda:
            if layer > 0:
                self._restore(layer - 1)
            if expert is not None:
                self._stage(layer + 2, int(expert[0]))
            return
        self._compute_done.record()
        self._stream.wait_event(self._compute_done)
        with torch.cuda.stream(self._stream):
            if layer > 0:
                self._restore_on_device(layer - 1)
            if expert is not None:
                self._stage_on_device(layer + 2, expert)
                self._staged[(layer + 2) % ROWS].record(self._stream)

    def wait_for(self, layer: int) -> None:
        """The compute stream waits until what was staged for `layer` is in place (and its state
        written), without waiting for later layers' staging (no host sync)."""
        if self._cuda:
            torch.cuda.current_stream().wait_event(self._staged[layer % ROWS])

    def after_layer(self, layer: int) -> None:
        """Layer `layer`'s kernel is enqueued: the last layer restores its own entry, and the compute
        stream waits for everything staged in this step."""
        if layer != self._layers - 1:
            return
        if not self._cuda:
            self._restore(layer)
            return
        self._compute_done.record()
        self._stream.wait_event(self._compute_done)
        with torch.cuda.stream(self._stream):
            self._restore_on_device(layer)
        torch.cuda.current_stream().wait_stream(self._stream)

    def _stage_on_device(self, target: int, expert: torch.Tensor) -> None:
        r = self._residency
        row = target % ROWS
        first_uid = target * self._experts
        self._kernels.stage_copy(expert, r.entries, r.blob_addresses, self._rows[row], first_uid)
        self._kernels.stage_commit(expert, r.entries, r.blob_addresses, r.staging[target], first_uid,
                                   self._row_addresses[row])

    def _restore_on_device(self, layer: int) -> None:
        r = self._residency
        self._kernels.stage_restore(r.entries, r.blob_addresses, r.staging[layer], r.pending[layer],
                                    layer * self._experts)

    def _stage(self, target: int, expert: int) -> None:
        """The CPU path of stage_copy + stage_commit."""
        r, state = self._residency, self._residency.staging[target]
        uid = target * self._experts + expert
        placed = bool(r.entries[uid] == r.blob_addresses[uid])
        address = self._row_addresses[target % ROWS] if placed else 0
        if placed:
            row = self._rows[target % ROWS]
            row.copy_(self._store.blob(target, expert))
            r.entries[uid] = address
            r.rows[target][expert] = row
        state[UID] = uid
        state[PLACED] = address
        state[ISSUED] += int(placed)

    def _restore(self, layer: int) -> None:
        """The CPU path of stage_restore."""
        r, state = self._residency, self._residency.staging[layer]
        if not state[PLACED]:
            return
        uid = int(state[UID])
        expert = uid - layer * self._experts
        if r.entries[uid] == state[PLACED]:  # nothing rewrote it since (on the CPU nothing can)
            r.entries[uid] = r.blob_addresses[uid]
            r.rows[layer][expert] = self._store.blob(layer, expert)
        state[USED] += int(r.pending[layer, expert] > 0)
        state[PLACED] = 0
