"""The expert cache mechanism: carries out a policy's decisions on real slots (paper IV-C).

For each MoE layer call it asks the policy about every routed expert, copies admitted experts from
the host store into slots, and hands the kernel one blob per routed expert: a slot row when the
expert is resident, the store's own blob otherwise. It stages predicted experts ahead of use and
releases them once their layer is done (mira.cache.prefetcher decides which). Which expert goes
where is the policy's business (mira.cache.policy); how bytes move is the transfer layer's
(mira.cache.transfer).

Under lagged residency (mira.cache.lagged; DESIGN.md 2.8) decode calls skip the cache: they count
their routing on the device and read every expert through the layer's address table, which this
mechanism keeps in step with the slots. `settle`, once per forward step, asks the policy about the
counted tokens exactly as `fetch` would have, a step late. Prefetching then stages on the device,
in rows of the pool kept from the policy (`lagged_staging`, mira.cache.staging), and `settle`
books its copies with the step's counts.
"""

from __future__ import annotations

import torch

from mira.cache.lagged import LaggedResidency
from mira.cache.staging import ISSUED, ROWS, UID, USED, LaggedStaging
from mira.cache.policy import Access, Policy, Static, Tier
from mira.cache.slots import SlotPool
from mira.cache.telemetry import Telemetry
from mira.cache.prefetcher import PrefetchBook
from mira.cache.transfer import Transfer
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
        self.lagged: LaggedResidency | None = None  # made by the first lagged layer (`lagged_residency`)
        self.staging: LaggedStaging | None = None  # made by the first lagged layer that predicts (`lagged_staging`)
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
            uid, access = self._access(layer_position, expert, count)
            if access.tier == Tier.MISS and not access.admit:
                blobs[expert] = self.transfer.serve_from_host(self.store.blob(layer_position, expert))
            else:
                slot = self._slot_of[uid]
                self.transfer.ready(slot)
                blobs[expert] = self.pool.row(slot)
        return blobs

    def lagged_residency(self) -> LaggedResidency:
        """Switch to lagged residency (on the first call; later calls return the same object): from
        now on every change of residency is written into the address tables, and `settle` must be
        called once per forward step. The current stream waits for the copies of the experts
        resident now (call it from the stream that computes)."""
        if self.lagged is None:
            self.lagged = LaggedResidency(self.store, self.pool, self.transfer.device)
            for uid, slot in self._slot_of.items():
                self.transfer.ready(slot)
                self.lagged.to_slot(uid, slot)
        return self.lagged

    def lagged_staging(self) -> LaggedStaging:
        """Prefetching under lagged residency (mira.cache.staging), made on the first call: it keeps
        `ROWS` slots of the pool, which the policy's capacity must leave free."""
        if self.staging is None:
            rows = [self.pool.row(self.pool.take()) for _ in range(ROWS)]
            self.staging = LaggedStaging(self.lagged_residency(), self.store, rows, self.transfer)
        return self.staging

    def settle(self) -> None:
        """Ask the policy about the tokens lagged layers routed since the last settle; a no-op inline.

        Reads every layer's counters back with one host sync, then for each layer with routed
        experts does what `fetch` does for them (policy accesses in ascending expert order,
        telemetry, admissions into slots), so the policy sees the accesses inline layers would
        have shown it. Residency changes reach the tables as `lagged_residency` says. Call it once
        per forward step, after the step, on the compute stream.

        Telemetry records the tier the policy reports, as inline; what the kernels read may
        differ: an expert whose copy was still in flight when its layer ran was read zero-copy
        from the host store yet counts as a hit, and one evicted earlier in the same settle (by
        another layer's admission) counts as a miss though its layer read it from its slot. An
        expert that lagged staging placed for its layer and the layer routed to counts as STAGE
        where the policy reports a miss (the policy never sees stage rows; the same caveat about
        late copies applies), and the copies staging issued count as prefetches.
        """
        if self.lagged is None:
            return
        counts, states = self.lagged.drain()
        E = self.store.num_experts
        for layer_position, (per_expert, state) in enumerate(zip(counts, states)):
            staged = state[UID] - layer_position * E if state[USED] else None
            self._count_staging(state[ISSUED], state[USED])
            experts = [e for e, count in enumerate(per_expert) if count]  # ascending ids
            if not experts:
                continue
            self.policy.begin_group()
            for expert in experts:
                self._access(layer_position, expert, per_expert[expert], staged=expert == staged)

    def resident_for_good(self, layer_position: int) -> bool:
        """Whether every expert of the layer is resident for good (a static placement that holds them
        all): its experts' rows never change, so the layer needs no lookup and no host sync."""
        E = self.store.num_experts
        uids = range(layer_position * E, (layer_position + 1) * E)
        return isinstance(self.policy, Static) and all(uid in self._slot_of for uid in uids)

    def fixed_rows(self, layer_position: int) -> list[torch.Tensor] | None:
        """The slot rows of every expert of a layer resident for good (`resident_for_good`), else
        None. The current stream waits for their copies to land (once: call it from the stream that
        computes)."""
        if not self.resident_for_good(layer_position):
            return None
        E = self.store.num_experts
        slots = [self._slot_of[uid] for uid in range(layer_position * E, (layer_position + 1) * E)]
        for slot in slots:
            self.transfer.ready(slot)
        return [self.pool.row(slot) for slot in slots]

    def stage(self, layer_position: int, experts: list[int]) -> None:
        """Offer the experts predicted for MoE layer `layer_position` to STAGE (copies ahead of use)."""
        uids = [layer_position * self.store.num_experts + e for e in experts]
        self.book.stage(self.policy, layer_position, uids,
                        admit=lambda uid, access: self._copy_in(uid, self._slot_for(access), prefetch=True))

    def after_layer(self, layer_position: int, experts: list[int]) -> None:
        """Layer `layer_position` has computed with `experts`: release the staged experts it is done with."""
        routed = [layer_position * self.store.num_experts + e for e in experts]
        for uid in self.book.after_layer(self.policy, layer_position, routed):
            self.pool.give(self._vacate(uid))

    def end_step(self, tokens: int) -> None:
        """A forward step of `tokens` tokens has finished; drop residency the policy gave up on."""
        self.policy.end_step(tokens)
        resident = self.policy.resident()
        for uid in [u for u in self._slot_of if u not in resident]:
            self.pool.give(self._vacate(uid))

    def _access(self, layer_position: int, expert: int, tokens: int, staged: bool = False) -> tuple[int, Access]:
        """Ask the policy about one routed expert, carry out an admission and record the tokens
        (`staged`: lagged staging served them from a stage row)."""
        uid = layer_position * self.store.num_experts + expert
        access = self.policy.access(uid, tokens)
        if access.admit:
            self._copy_in(uid, self._slot_for(access), prefetch=False)
        tier = Tier.STAGE if staged and access.tier is Tier.MISS else access.tier
        self.telemetry.record(layer_position, expert, tokens, tier)
        return uid, access

    def _count_staging(self, issued: int, used: int) -> None:
        """Lagged staging's copies of one target layer in one step, in the prefetch counts."""
        counts = self.book.counts
        counts.issued += issued
        counts.used += used
        counts.wasted += issued - used
        for _ in range(issued):
            self.telemetry.record_copy(self.store.blob_bytes, prefetch=True)

    def _slot_for(self, access: Access) -> int:
        return self._vacate(access.evict) if access.evict is not None else self.pool.take()

    def _vacate(self, uid: int) -> int:
        """Take `uid` out of its slot and return the slot. Lagged, its table entry goes back to its
        host blob on the compute stream, after the slot's last copy and the entry written behind it
        (else that late write could land over this one), and before any later copy into the slot,
        which waits for the compute stream."""
        slot = self._slot_of.pop(uid)
        if self.lagged is not None:
            self.transfer.ready(slot)
            self.lagged.to_host(uid)
        return slot

    def _copy_in(self, uid: int, slot: int, prefetch: bool) -> None:
        self._slot_of[uid] = slot
        then = (lambda: self.lagged.to_slot(uid, slot)) if self.lagged is not None else None
        self.transfer.load(self.store.blob(*divmod(uid, self.store.num_experts)), self.pool.row(slot), slot,
                           prefetch=prefetch, then=then)
        self.telemetry.record_copy(self.store.blob_bytes, prefetch=prefetch)
