"""Expert slots: one buffer allocated once, [S, B] uint8 on the device (DESIGN.md 2.5).

A slot holds one expert blob. Nothing on the hot path allocates: taking and returning slots only
moves integers between lists.
"""

from __future__ import annotations

import torch


class SlotPool:
    def __init__(self, num_slots: int, blob_bytes: int, device: torch.device):
        self.buffer = torch.empty(num_slots, blob_bytes, dtype=torch.uint8, device=device)  # [S, B]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[0]

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free expert slot: the policy admitted more experts than it has slots for")
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def row(self, slot: int) -> torch.Tensor:
        return self.buffer[slot]
