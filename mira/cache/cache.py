"""The expert cache mechanism: carries out a policy's decisions on real slots (paper IV-C).

For each MoE layer call it asks the policy about every routed expert, copies admitted experts from
the host store into slots, and hands the kernel one blob per routed expert: a slot row when the
expert is resident, the store's own blob otherwise. Which expert goes where is the policy's
business (mira.cache.policy); how bytes move is the transfer layer's (mira.runtime.transfer).
"""

from __future__ import annotations

import torch

from mira.cache.policy import Policy, Tier
from mira.cache.slots import SlotPool
from mira.cache.telemetry import Telemetry
from mira.runtime.transfer import Transfer
from mira.store.store import ExpertStore


class ExpertCache:
    def __init__(self, store: ExpertStore, policy: Policy, pool: SlotPool, transfer: Transfer,
                 telemetry: Telemetry):
        if policy.capacity > pool.num_slots:
            raise ValueError(f"policy capacity {policy.capacity} exceeds the {pool.num_slots} slots")
        self.store = store
        self.policy = policy
        self.pool = pool
        self.transfer = transfer
        self.telemetry = telemetry
        self._slot_of: dict[int, int] = {}  # uid -> slot
        self._blobs: list[torch.Tensor | None] = [None] * store.num_experts  # reused by every call
        for uid in sorted(policy.resident()):  # a policy may start with a placement (static)
            self._slot_of[uid] = slot = pool.take()
            transfer.load(store.blob(*divmod(uid, store.num_experts)), pool.row(slot))
            telemetry.record_copy(store.blob_bytes)
        transfer.end_layer()

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
            if access.tier != Tier.MISS:
                blobs[expert] = self.pool.row(self._slot_of[uid])
            elif access.admit:
                slot = self._slot_of.pop(access.evict) if access.evict is not None else self.pool.take()
                self._slot_of[uid] = slot
                blobs[expert] = self.transfer.load(self.store.blob(layer_position, expert), self.pool.row(slot))
                self.telemetry.record_copy(self.store.blob_bytes)
            else:
                blobs[expert] = self.transfer.serve_from_host(self.store.blob(layer_position, expert))
            self.telemetry.record(layer_position, expert, count, access.tier)
        self.transfer.end_layer()
        return blobs

    def end_step(self, tokens: int) -> None:
        """A forward step of `tokens` tokens has finished; drop residency the policy gave up on."""
        self.policy.end_step(tokens)
        resident = self.policy.resident()
        for uid in [u for u in self._slot_of if u not in resident]:
            self.pool.give(self._slot_of.pop(uid))
