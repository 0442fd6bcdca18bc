"""Token-level telemetry of the expert cache (paper IV-D): per expert, tokens routed and served by tier.

The mechanism records every served expert; these cumulative figures feed reports and
`--stats-json`. (Policies keep their own sliding windows from the accesses they see.) A layer
whose experts are all resident for good records on the device instead, with no host sync
(`device_counters`); those counters are folded into the figures whenever they are read. Lagged
layers' tokens are recorded when the cache settles them after their step
(`ExpertCache.settle`), with the tier the policy reports then: a hit whose copy was still in
flight when its layer ran was in fact read zero-copy from the host store.
"""

from __future__ import annotations

import numpy as np
import torch

from mira.cache.policy import Tier


class Telemetry:
    """counts[layer, expert] = (tokens routed, tokens served from HOT, from STAGE, from the host store)."""

    def __init__(self, num_layers: int, num_experts: int):
        self._counts = np.zeros((num_layers, num_experts, 1 + len(Tier)), dtype=np.int64)
        self.accesses = np.zeros(len(Tier), dtype=np.int64)  # (layer, expert) lookups by tier
        self.bytes_to_device = 0  # on-demand copies (misses admitted into a slot)
        self.copies = 0
        self.prefetch_bytes = 0  # copies ahead of use into STAGE
        self.prefetch_copies = 0
        self._on_device: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, routed [E], lookups [E])

    @property
    def counts(self) -> np.ndarray:
        """int64 [L, E, 1 + tiers]: tokens routed, then tokens served by each tier."""
        self._fold()
        return self._counts

    def device_counters(self, layer_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Counters a layer adds to on the device for experts served from HOT: tokens routed [E] and
        lookups [E] (1 per call that routes the expert)."""
        num_experts = self._counts.shape[1]
        routed = torch.zeros(num_experts, dtype=torch.int64, device=device)
        lookups = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self._on_device.append((layer_position, routed, lookups))
        return routed, lookups

    def _fold(self) -> None:
        """Move the device counters into the host figures (a host sync, only when figures are read)."""
        for layer_position, routed, lookups in self._on_device:
            tokens = np.asarray(routed.tolist(), dtype=np.int64)
            self._counts[layer_position, :, 0] += tokens
            self._counts[layer_position, :, 1 + Tier.HOT] += tokens
            self.accesses[Tier.HOT] += sum(lookups.tolist())
            routed.zero_()
            lookups.zero_()

    def record(self, layer_position: int, expert: int, tokens: int, tier: Tier) -> None:
        row = self._counts[layer_position, expert]
        row[0] += tokens
        row[1 + tier] += tokens
        self.accesses[tier] += 1

    def record_copy(self, nbytes: int, prefetch: bool = False) -> None:
        if prefetch:
            self.prefetch_bytes += nbytes
            self.prefetch_copies += 1
        else:
            self.bytes_to_device += nbytes
            self.copies += 1

    def summary(self) -> dict:
        totals = self.counts.sum(axis=(0, 1))  # (folds the device counters first)
        lookups = int(self.accesses.sum())
        return {
            "tokens_routed": int(totals[0]),
            "tokens_served": {tier.name.lower(): int(totals[1 + tier]) for tier in Tier},
            "lookups": {tier.name.lower(): int(self.accesses[tier]) for tier in Tier},
            "hit_rate": float(self.accesses[Tier.HOT] + self.accesses[Tier.STAGE]) / lookups if lookups else 0.0,
            "copies": self.copies,
            "bytes_to_device": self.bytes_to_device,
            "prefetch_copies": self.prefetch_copies,
            "prefetch_bytes": self.prefetch_bytes,
        }
