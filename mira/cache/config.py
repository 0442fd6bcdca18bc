"""How the expert slots are split and managed: the cache's own settings (paper IV-C, IV-D)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("mira", "lru", "lfu", "static", "on-demand")
STAGING_ROWS = 3  # target layers staged at once (mira.cache.staging): i (being computed), i+1 and i+2


@dataclass(frozen=True)
class CacheConfig:
    """How the expert slots are split and managed (paper IV-C, IV-D; DESIGN.md 2.5, 2.6).

    policy: which residency policy manages the slots.
    small_vram_fraction: below this share of all experts fitting in the slots, the cache runs in
        small-VRAM mode (a handful of STAGE slots reclaimed right after use); above, large-VRAM mode.
    stage_fraction_small / stage_fraction_large: the share of slots given to STAGE in each mode.
    rebalance_interval: tokens between two rebalancing passes of the mira policy.
    max_swaps: at most this many HOT<->STAGE swaps per pass.
    heat_decay: per token step, an expert's heat (its decayed routed-token count, the
        "frequency" of IV-D) is multiplied by this, so old popularity fades, which keeps the
        rebalancer free of LFU's pollution; in (0, 1].
    prior_weight: how many token steps of evidence the profile's popularity is worth in the mira
        policy's estimate of an expert's reuse, against its decayed heat.
    admission_margin: blobs by which the PCIe bytes an admission is expected to save must exceed
        what it moves, in the mira policy: a missed expert's heat, counted right after the access
        that missed, overstates its reuse.

    The heat decay, prior weight and admission margin come from `benchmarks/policies.py`'s sweep on
    the bundled model's training-split routing alone; `benchmarks/prefetch.py` measures the STAGE
    fractions.
    """

    policy: str = "mira"
    small_vram_fraction: float = 0.25
    stage_fraction_small: float = 0.5
    stage_fraction_large: float = 0.5
    rebalance_interval: int = 1
    max_swaps: int = 16
    heat_decay: float = 0.9
    prior_weight: float = 10.0
    admission_margin: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.rebalance_interval < 1 or self.max_swaps < 0:
            raise ValueError("rebalance_interval must be >= 1 and max_swaps >= 0")
        if not 0 < self.heat_decay <= 1:
            raise ValueError(f"heat_decay must be in (0, 1], got {self.heat_decay}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")
        if self.admission_margin < 0:
            raise ValueError(f"admission_margin must be >= 0, got {self.admission_margin}")
