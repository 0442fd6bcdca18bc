"""Frozen configuration objects, passed whole instead of long lists of flags (STYLE.md habit 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mira.store.layout import SCHEMES

POLICIES = ("mira", "lru", "lfu", "static", "on-demand")
PREFETCH = ("auto", "trained", "gate", "off")
RESIDENCY = ("auto", "lagged", "inline")  # how decode layers under a budget meet the cache (mira.cache.lagged)
# A MoE layer call of at most this many tokens is a decode step: the experts module and the
# predictors serve it from buffers allocated once, so it allocates no device memory (DESIGN.md
# 2.5). Larger calls (prefill) allocate their own. 16 covers batch-1 and small-batch decode.
DECODE_TOKENS = 16


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

    The mira policy's heat decay and prior weight were chosen by the sweep of `benchmarks/policies.py`
    on the training-split routing trace of the bundled model alone (its `tuning` in
    benchmarks/results/policies-real.json). The small-VRAM STAGE fraction is 0.5 because
    predicted experts need room: in a one-off comparison at 10 and 12 of 96 slots (under earlier
    staging rules, which let misses displace staged experts), gate prefetching removed no misses
    with 0.125 and the most with 0.5 of 0.125, 0.34 and 0.5;
    benchmarks/prefetch.py measures the chosen setting (results/prefetch-tiny.json).
    """

    policy: str = "mira"
    small_vram_fraction: float = 0.25
    stage_fraction_small: float = 0.5
    stage_fraction_large: float = 0.5
    rebalance_interval: int = 1
    max_swaps: int = 16
    heat_decay: float = 0.97
    prior_weight: float = 30.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.rebalance_interval < 1 or self.max_swaps < 0:
            raise ValueError("rebalance_interval must be >= 1 and max_swaps >= 0")
        if not 0 < self.heat_decay <= 1:
            raise ValueError(f"heat_decay must be in (0, 1], got {self.heat_decay}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how a model runs.

    device: "cuda", "cuda:N" or "cpu".
    dtype: compute dtype of the non-expert weights and activations: bfloat16 on CUDA; float32 on
        the CPU, where bf16 matmuls are slow on most processors and float32 makes the CPU path an
        exact reference.
    vram_budget: bytes of device memory Mira may use (weights, KV cache, workspaces, expert slots);
        None means the free memory less a margin on CUDA, and room for every expert on the CPU.
    max_context: tokens of KV cache reserved (prompt + generated).
    quant: expert quantization scheme of the store.
    """

    device: str = "cpu"
    dtype: str = ""
    vram_budget: int | None = None
    max_context: int = 4096
    quant: str = "int8-shared"
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.quant not in SCHEMES:
            raise ValueError(f"unknown quantization {self.quant!r}; choose one of {', '.join(SCHEMES)}")
        if not self.dtype:
            object.__setattr__(self, "dtype", "float32" if self.device == "cpu" else "bfloat16")
        if self.max_context < 1:
            raise ValueError("max_context must be >= 1")
