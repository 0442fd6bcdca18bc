"""Lagged staging (mira.cache.staging) on one store's tables: the Triton kernels of
mira.kernels.staging and DeviceStaging's CPU path (their PyTorch reference) each take the same
sequence of layer calls, and both must end where a hand-worked account of it says.

Without CUDA the kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in
tests/conftest.py before triton is imported), reading the store's blobs by address.

The sequence, on the tiny Mixtral store (3 MoE layers of 8 experts), expert (0, 5) holding slot 0:
- layer 0 predicts expert 3 for layer 2: it has no slot, so its blob is copied into stage row 2
  (2 % 3) and its entry points there; issued 1.
- layer 1 predicts nothing; layer 2 routes expert 3 and computes; the last layer restores it:
  entry back on its blob, used 1.
- a second step: layer 0 predicts (2, 3) again, but it now holds slot 1: nothing is copied or issued.
- (2, 4) staged and, before its restore, its entry rewritten to a slot (an admission landing late
  on another stream): the restore leaves the slot's entry.
- a prediction that its layer does not route is restored with used 0.
"""

from __future__ import annotations

import pytest
import torch

from mira.cache.tables import ExpertTables
from mira.cache.slots import SlotPool
from mira.cache.staging import ROWS, DeviceStaging
from mira.cache.tables import ISSUED, PLACED, UID, USED
from mira.cache.transfer import Transfer
from mira.store.store import ExpertStore

E = 8
SENTINEL = 0xA5


class _KernelStaging(DeviceStaging):
    """DeviceStaging with its CPU path replaced by the Triton kernels (interpreted without CUDA)."""

    def __init__(self, *args):
        super().__init__(*args)
        from mira.kernels import staging as kernels

        self._kernels = kernels

    def _stage(self, target: int, expert: int) -> None:
        self._stage_on_device(target, torch.tensor([expert], device=self._rows[0].device))

    def _restore(self, layer: int) -> None:
        self._restore_on_device(layer)


def _setup(store_path, staging_class):
    pytest.importorskip("triton")
    store = ExpertStore.open(store_path, progress=False)
    pool = SlotPool(2 + ROWS, store.blob_bytes, torch.device("cpu"))
    residency = ExpertTables(store, pool, torch.device("cpu"))
    residency.to_slot(0 * E + 5, pool.take())  # (0, 5) in slot 0
    rows = [pool.row(pool.take()) for _ in range(ROWS)]
    for row in rows:
        row.fill_(SENTINEL)
    transfer = Transfer(torch.device("cpu"), pool.num_slots)
    return store, pool, residency, staging_class(residency, store, rows, transfer), rows


@pytest.mark.parametrize("staging_class", [DeviceStaging, _KernelStaging], ids=["pytorch", "triton"])
def test_staging_places_restores_and_counts(mixtral_store, staging_class):
    store, pool, residency, staging, rows = _setup(mixtral_store, staging_class)
    blob_of = lambda layer, expert: store.blob(layer, expert).data_ptr()  # noqa: E731

    staging.before_layer(0, torch.tensor([3]))  # layer 0 predicts (2, 3)
    assert torch.equal(rows[2], store.blob(2, 3))  # copied into row (2 % 3)
    assert (rows[0] == SENTINEL).all() and (rows[1] == SENTINEL).all()
    assert residency.tables[2, 3] == rows[2].data_ptr()
    assert residency.staging[2].tolist() == [2 * E + 3, rows[2].data_ptr(), 1, 0]  # uid, placed at, issued, used
    staging.after_layer(0)
    staging.before_layer(1, None)
    residency.pending[2, 3] += 1  # layer 2 routes expert 3
    staging.before_layer(2, None)
    assert residency.tables[2, 3] == rows[2].data_ptr()  # still staged while layer 2 computes
    staging.after_layer(2)  # the last layer restores its own entry
    assert residency.tables[2, 3] == blob_of(2, 3)
    assert residency.staging[2].tolist() == [2 * E + 3, 0, 1, 1]
    assert residency.tables[0, 5] == pool.row(0).data_ptr()  # the slot's entry untouched

    residency.drain()
    staging.before_layer(0, torch.tensor([4]))  # (2, 4) staged, then admitted into a slot before its restore
    assert residency.tables[2, 4] == rows[2].data_ptr()
    admitted = pool.take()
    residency.entries[2 * E + 4] = pool.row(admitted).data_ptr()  # as a late to_slot on the demand stream
    staging.before_layer(1, None)
    staging.before_layer(2, None)
    staging.after_layer(2)
    assert residency.tables[2, 4] == pool.row(admitted).data_ptr()  # the restore leaves the slot's entry
    assert residency.staging[2].tolist() == [2 * E + 4, 0, 1, 0]
    pool.give(admitted)

    residency.drain()
    slot = pool.take()
    residency.to_slot(2 * E + 3, slot)  # (2, 3) now has a slot of its own
    rows[2].fill_(SENTINEL)
    staging.before_layer(0, torch.tensor([3]))
    assert (rows[2] == SENTINEL).all()  # nothing copied
    assert residency.tables[2, 3] == pool.row(slot).data_ptr()
    assert residency.staging[2].tolist() == [2 * E + 3, 0, 0, 0]
    staging.before_layer(1, None)
    staging.before_layer(2, None)
    staging.after_layer(2)
    assert residency.tables[2, 3] == pool.row(slot).data_ptr()  # a slot's entry is never restored to the blob

    residency.drain()
    staging.before_layer(0, torch.tensor([6]))  # predicted, then not routed
    staging.before_layer(1, None)
    staging.before_layer(2, None)
    staging.after_layer(2)
    assert residency.tables[2, 6] == blob_of(2, 6)
    counts, states = residency.drain()
    assert states[2][ISSUED] == 1 and states[2][USED] == 0 and states[2][PLACED] == 0 and states[2][UID] == 2 * E + 6
    assert not any(map(any, counts))
