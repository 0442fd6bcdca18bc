"""The expert cache mechanism: carries out a policy's decisions on real slots (paper IV-C).

For each MoE layer call it asks the policy about every routed expert, copies admitted experts from
the host store into slots, and hands the kernel one blob per routed expert: a slot row when the
expert is resident, the store's own blob otherwise. It stages predicted experts ahead of use and
releases them once their layer is done (mira.predict.prefetcher decides which). Which expert goes
where is the policy's business (mira.cache.policy); how bytes move is the transfer layer's
(mira.runtime.transfer).
"""

from __future__ import annotations

import torch

from mira.cache.policy import Access, Policy, Static, Tier
from mira.cache.slots import SlotPool
from mira.cache.telemetry import Telemetry
from mira.predict.prefetcher import PrefetchBook
from mira.runtime.transfer import Transfer
from mira.store.store import ExpertStore


class ExpertCache:
    def __init__(self, store: ExpertStore, policy: Policy, pool: SlotPool, transfer: Transfer,
                 telemetry: Telemetry, book: PrefetchBook | None = None):
        if policy.capacity > pool.num_slots:
            raise ValueError(f"policy capacity {policy.capacity} exceeds the {pool.num_slots} slots")
        self.store = store
        self.policy = policy
        self.pool = pool
        self.transfer = transfer
        self.telemetry = telemetry
        self.book = book or PrefetchBook()
        self._slot_of: dict[int, int] = {}  # uid -> slot
        self._blobs: list[torch.Tensor | None] = [None] * store.num_experts  # reused by every call
        for uid in sorted(policy.resident()):  # a policy may start with a placement (static)
            self._copy_in(uid, self.pool.take(), prefetch=False)

    def fetch(self, layer_position: int, experts: list[int], tokens: list[int]) -> list[torch.Tensor | None]:
        """Blobs for one layer call.

        Args:
            layer_position: index of the MoE layer among MoE layers.
            experts: distinct routed expert ids, ascending.
            tokens: tokens routed to each of them.

        Returns:
            A list of length E: the blob of every routed expert (device-readable), None elsewhere.
            The list is reused by the next call.
        """
        blobs = self._blobs
        blobs[:] = [None] * len(blobs)
        self.policy.begin_group()
        self.transfer.begin_layer()
        for expert, count in zip(experts, tokens):
            uid = layer_position * self.store.num_experts + expert
            access = self.policy.access(uid, count)
            if access.tier == Tier.MISS and not access.admit:
                blobs[expert] = self.transfer.serve_from_host(self.store.blob(layer_position, expert))
            else:
                if access.admit:
                    self._copy_in(uid, self._slot_for(access), prefetch=False)
                slot = self._slot_of[uid]
                self.transfer.ready(slot)
                blobs[expert] = self.pool.row(slot)
            self.telemetry.record(layer_position, expert, count, access.tier)
        return blobs

    def fixed_rows(self, layer_position: int) -> list[torch.Tensor] | None:
        """The slot rows of every expert of a layer whose experts are all resident for good (a static
        placement that holds them all), else None. Such a layer needs no lookup and no host sync:
        its experts' rows never change. The current stream waits for their copies to land (once:
        call it from the stream that computes)."""
        E = self.store.num_experts
        uids = range(layer_position * E, (layer_position + 1) * E)
        if not isinstance(self.policy, Static) or any(uid not in self._slot_of for uid in uids):
            return None
        for uid in uids:
            self.transfer.ready(self._slot_of[uid])
        return [self.pool.row(self._slot_of[uid]) for uid in uids]

    def stage(self, layer_position: int, experts: list[int]) -> None:
        """Offer the experts predicted for MoE layer `layer_position` to STAGE (copies ahead of use)."""
        uids = [layer_position * self.store.num_experts + e for e in experts]
        self.book.stage(self.policy, layer_position, uids,
                        admit=lambda uid, access: self._copy_in(uid, self._slot_for(access), prefetch=True))

    def after_layer(self, layer_position: int, experts: list[int]) -> None:
        """Layer `layer_position` has computed with `experts`: release the staged experts it is done with."""
        routed = [layer_position * self.store.num_experts + e for e in experts]
        for uid in self.book.after_layer(self.policy, layer_position, routed):
            self.pool.give(self._slot_of.pop(uid))

    def end_step(self, tokens: int) -> None:
        """A forward step of `tokens` tokens has finished; drop residency the policy gave up on."""
        self.policy.end_step(tokens)
        resident = self.policy.resident()
        for uid in [u for u in self._slot_of if u not in resident]:
            self.pool.give(self._slot_of.pop(uid))

    def _slot_for(self, access: Access) -> int:
        return self._slot_of.pop(access.evict) if access.evict is not None else self.pool.take()

    def _copy_in(self, uid: int, slot: int, prefetch: bool) -> None:
        self._slot_of[uid] = slot
        self.transfer.load(self.store.blob(*divmod(uid, self.store.num_experts)), self.pool.row(slot), slot,
                           prefetch=prefetch)
        self.telemetry.record_copy(self.store.blob_bytes, prefetch=prefetch)
