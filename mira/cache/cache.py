"""The expert cache mechanism: carries out a policy's decisions on real slots (paper IV-C).

Every MoE layer computes from the address tables (mira.cache.tables), which this mechanism keeps in
step with the slots, and counts its routed tokens on the device. Settling asks the policy about
each routed expert in ascending id, copies admitted experts from the host store into slots and
points their entries at them once the copies land: before the layer's kernel (`settle_layer`,
inline residency) or for every layer after the step (`settle`, lagged residency). Which expert
goes where is the policy's business (mira.cache.policy); how bytes move is the transfer layer's
(mira.cache.transfer); prefetching stages on the device, in rows kept from the policy
(`staging`, mira.cache.staging).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mira.cache.policy import Access, Policy, Tier
from mira.cache.slots import SlotPool
from mira.cache.staging import ROWS, DeviceStaging, PrefetchCounts
from mira.cache.tables import ISSUED, PLACED, UID, USED, ExpertTables
from mira.cache.telemetry import Telemetry
from mira.cache.transfer import Transfer
from mira.store.store import ExpertStore


class Settled(NamedTuple):
    """One layer's routed experts, (expert, tokens) each, as settled before its kernel.

    on_device: read from device memory (slots, stage rows).
    from_host: read from their host blobs (misses the policy did not admit).
    copied: those of on_device whose slot is being filled by this settle's admission: their copy
        comes before their kernel.
    """

    on_device: list[tuple[int, int]]
    from_host: list[tuple[int, int]]
    copied: list[tuple[int, int]]


class ExpertCache:
    """The slots, the tables that say where each expert is read, and the policy that fills them.

    all_resident: every expert holds a slot for good (copied in at construction); settling then
        only counts tokens, with no policy call.
    """

    def __init__(self, store: ExpertStore, policy: Policy, pool: SlotPool, transfer: Transfer,
                 telemetry: Telemetry):
        if policy.capacity > pool.num_slots:
            raise ValueError(f"policy capacity {policy.capacity} exceeds the {pool.num_slots} slots")
        self.store = store
        self.policy = policy
        self.pool = pool
        self.transfer = transfer
        self.telemetry = telemetry
        self.tables = ExpertTables(store, pool, transfer.device)
        self.staging: DeviceStaging | None = None  # made by the first layer that predicts (`device_staging`)
        self.prefetch = PrefetchCounts()
        self._slot_of: dict[int, int] = {}  # uid -> slot
        for uid in sorted(policy.resident()):  # a policy may start with a placement (static)
            self._copy_in(uid, self.pool.take())
        self.all_resident = len(self._slot_of) == store.num_layers * store.num_experts
        for slot in self._slot_of.values():  # the compute stream waits for the placement to land
            self.transfer.ready(slot)

    def device_staging(self) -> DeviceStaging:
        """Prefetching (mira.cache.staging), made on the first call: it keeps `ROWS` slots of the
        pool, which the policy's capacity must leave free."""
        if self.staging is None:
            rows = [self.pool.row(self.pool.take()) for _ in range(ROWS)]
            self.staging = DeviceStaging(self.tables, self.store, rows, self.transfer)
        return self.staging

    def settle_layer(self, layer_position: int) -> Settled:
        """Inline: before layer `layer_position`'s kernel, read its counted tokens back (one host
        sync) and ask the policy about them; the compute stream then waits for the routed experts'
        slots, so an admitted miss is read from HBM after its one copy.

        Returns:
            The routed experts by where the kernel reads them, ascending (`Settled`).
        """
        if self.staging is not None:  # what layer - 2 staged for this layer, and its state, must be in place
            self.staging.wait_for(layer_position)
        per_expert, state = self.tables.drain_layer(layer_position)
        staged = state[UID] - layer_position * self.store.num_experts if state[PLACED] else None
        if staged is not None and per_expert[staged]:  # counted here: the restore after the kernel sees no tokens
            self.prefetch.used += 1
        settled = Settled([], [], [])
        for expert, admitted in self._settle(layer_position, per_expert, staged):
            uid = layer_position * self.store.num_experts + expert
            if uid in self._slot_of:
                self.transfer.ready(self._slot_of[uid])
            routed = (expert, per_expert[expert])
            (settled.on_device if uid in self._slot_of or expert == staged else settled.from_host).append(routed)
            if admitted:
                settled.copied.append(routed)
        return settled

    def settle(self, sent: bool = False) -> None:
        """Once per forward step, after it: read every layer's counters back at once and settle the
        tokens lagged layers routed, layer by layer, as `settle_layer` would have (a step late);
        book the step's staging. With `sent`, the counters `ExpertTables.send_back` sent instead.

        Telemetry records the tier the policy reports; what the kernels read may differ: an expert
        whose copy was still in flight when its layer ran was read zero-copy from the host store
        yet counts as a hit, and one evicted earlier in the same settle (by another layer's
        admission) counts as a miss though its layer read it from its slot. An expert that staging
        placed for its layer and the layer routed to counts as STAGE where the policy reports a
        miss (the policy never sees stage rows; the same caveat about late copies applies).
        """
        counts, states = self.tables.drain(sent)
        if self.all_resident:
            self.telemetry.record_layers(counts, Tier.HOT)
            return
        E = self.store.num_experts
        self._count_staging(int(states[:, ISSUED].sum()), int(states[:, USED].sum()))
        staged = [uid - layer * E if used else None
                  for layer, (uid, used) in enumerate(states[:, [UID, USED]].tolist())]
        layers, experts = np.nonzero(counts)  # row-major: by layer, then ascending expert id
        tokens = counts[layers, experts].tolist()
        last = -1
        for layer_position, expert, routed in zip(layers.tolist(), experts.tolist(), tokens):
            if layer_position != last:
                self.policy.begin_group()
                last = layer_position
            self._access(layer_position, expert, routed, staged=expert == staged[layer_position])

    def end_step(self, tokens: int) -> None:
        """A forward step of `tokens` tokens has finished; drop residency the policy gave up on."""
        self.policy.end_step(tokens)
        resident = self.policy.resident()
        for uid in [u for u in self._slot_of if u not in resident]:
            self.pool.give(self._vacate(uid))

    def _settle(self, layer_position: int, per_expert: list[int], staged: int | None) -> list[tuple[int, bool]]:
        """Policy accesses for one layer's routed tokens, in ascending expert id; the experts routed,
        each with whether it was admitted (copied in now)."""
        experts = [e for e, count in enumerate(per_expert) if count]
        if experts:
            self.policy.begin_group()
        return [(expert, self._access(layer_position, expert, per_expert[expert], staged=expert == staged).admit)
                for expert in experts]

    def _access(self, layer_position: int, expert: int, tokens: int, staged: bool) -> Access:
        """Ask the policy about one routed expert, carry out an admission and record the tokens
        (`staged`: staging served them from a stage row)."""
        uid = layer_position * self.store.num_experts + expert
        access = self.policy.access(uid, tokens)
        if access.admit:
            self.prefetch.admitted += staged and access.tier is Tier.MISS
            self._copy_in(uid, self._vacate(access.evict) if access.evict is not None else self.pool.take())
        tier = Tier.STAGE if staged and access.tier is Tier.MISS else access.tier
        self.telemetry.record(layer_position, expert, tokens, tier)
        return access

    def _count_staging(self, issued: int, used: int) -> None:
        """Staging's copies in one step, in the prefetch counts."""
        self.prefetch.issued += issued
        self.prefetch.used += used
        for _ in range(issued):
            self.telemetry.record_copy(self.store.blob_bytes, prefetch=True)

    def _vacate(self, uid: int) -> int:
        """Take `uid` out of its slot and return the slot. Its table entry goes back to its host blob
        on the compute stream, after the slot's last copy and the entry written behind it (else that
        late write could land over this one), and before any later copy into the slot, which waits
        for the compute stream."""
        slot = self._slot_of.pop(uid)
        self.transfer.ready(slot)
        self.tables.to_host(uid)
        return slot

    def _copy_in(self, uid: int, slot: int) -> None:
        self._slot_of[uid] = slot
        self.transfer.load(self.store.blob(*divmod(uid, self.store.num_experts)), self.pool.row(slot), slot,
                           then=lambda: self.tables.to_slot(uid, slot))
        self.telemetry.record_copy(self.store.blob_bytes)
