"""Whether decode layers under a budget run lagged or inline (`load`'s `residency`; mira.cache.lagged).

Lagged, no MoE layer syncs with the host, so a decode step can be replayed as a CUDA graph; the
price is that an expert the policy admits after a miss crosses PCIe twice (read by the kernel, then
copied into its slot), and that staging ahead is decided on the device: one predicted expert per
layer, into rows apart from the policy's (mira.cache.staging). Inline, every MoE layer costs one
host sync and the host's policy work, a miss crosses once, and staging goes through the policy's
STAGE slots. Which is faster depends on how long one expert takes to cross PCIe against the
host's time per layer. Measured on the H200 (mira bench, random routing for the synthetic shape):

- Qwen3-30B-A3B shape, 4.7 MB blobs (86 us at 55 GB/s), 64 in / 256 out,
  bench-qwen3-30b-a3b-lagged.json: lagged mira 65.4 tokens/s at 24 GiB against 10.9 inline (6.0x);
  lagged LRU 72.3 against 12.1 at 8 GiB (6.0x) and 78.5 against 11.8 at 24 GiB (6.7x). This
  preset's decode routing barely varied then (before 2e51f91, mira.bench.synthetic), so these runs
  had few misses after the prompt: they measure the host path more than the cost of a miss.
- The bundled model's real routing (61-100% of routed tokens missed),
  bench-mira-tiny-moe-lagged.json: lagged mira 254 tokens/s at 25% against 43.1 inline (5.9x);
  lagged LRU 163 against 45.4 at 10% (3.6x), 253 against 45.8 at 25% (5.5x). (Each run's first
  row under a budget, inline mira at the smallest budget, was slower than the same configuration
  elsewhere, for a reason not yet found; its ratios, 7.8x and 15.9x, are left out.)
- Mixtral-8x7B shape, 176 MB blobs (3.2 ms), at 24 GiB (bench at cfa322e, since replaced): lagged
  mira 0.89x inline, lagged LRU 0.61x.
- In bytes (lagged-traffic-tiny.json, the bundled model's real routing): lagged mira moves
  1.09-1.31x the blobs of inline, lagged LRU 1.9x.
- With a predictor, staging on the device (lagged) against through the policy (inline), mira
  bench at d5cb626: DeepSeek-V2-Lite shape (8.7 MB blobs, 157 us), gate speculation, 28.3 tokens/s
  against 7.38 at 8 GiB (3.8x) and 53.4 against 16.4 at 12 GiB (3.3x),
  bench-deepseek-v2-lite-staging.json; the bundled model, trained heads, 226 against 19.0 at 10%
  (11.9x) and 261 against 38.9 at 25% (6.7x), bench-mira-tiny-moe-staging.json; Mixtral shape at
  24 GiB, 6.39 against 5.84 (1.09x; one run, the lagged side measured first),
  bench-mixtral-8x7b-staging.json. Staging gained nothing over lagged mira without it (DeepSeek
  1.05x and 0.97x; the bundled model 0.61x and 0.73x, its trained heads' kernels in every step).

So "auto" lags on CUDA when one blob crosses PCIe in at most `LAG_BELOW_S`, with or without a
predictor; it always lags policies that never admit a miss (static, on-demand), which lose
nothing by it; on the CPU, where there is no PCIe and no measurement, only those. Nothing lags
when every expert fits (those layers never sync anyway), nor on CUDA without the fused kernels,
which read unslotted experts from the pinned store. Whether a lagged model stages is the engine's
`stages` (mira.runtime.engine.assemble): with a predictor named, or with residency "lagged" asked
for, but not for `prefetch="auto"` under "auto" residency, where staging did not pay.
"""

from __future__ import annotations

import torch

from mira.config import RESIDENCY
from mira.errors import MiraError

PINNED_BYTES_PER_S = 55e9  # pinned host-to-device copy on the H200 (DESIGN.md 3)
LAG_BELOW_S = 1e-3  # between the measured wins (86 us) and losses (3.2 ms) above
NAMED_PREDICTORS = ("trained", "gate")


def lags(residency: str, *, admits_misses: bool, under_budget: bool, device: torch.device, fused_kernels: bool,
         blob_bytes: int) -> bool:
    """Whether decode layers run lagged.

    Args:
        residency: "auto", "lagged" or "inline".
        admits_misses: whether the residency policy ever admits a miss (mira.cache.policy.Policy).
        under_budget: whether some expert has no slot.
        device: where the model runs.
        fused_kernels: whether the expert FFN reads blobs by address (TritonMoEFFN).
        blob_bytes: one expert's blob.

    Raises:
        MiraError: an unknown residency.
    """
    if residency not in RESIDENCY:
        raise MiraError(f"unknown residency {residency!r}; choose one of {', '.join(RESIDENCY)}")
    possible = under_budget and (device.type == "cpu" or fused_kernels)
    if not possible or residency == "inline":
        return False
    if residency == "lagged" or not admits_misses:
        return True
    if device.type != "cuda":
        return False
    return blob_bytes / PINNED_BYTES_PER_S <= LAG_BELOW_S


def stages(prefetch: str, residency: str, lagged: bool, stage_slots: int) -> bool:
    """Whether the model stages predicted experts: where the policy has STAGE slots and a predictor
    is asked for; under lagged residency (on the device, mira.cache.staging) only when the
    predictor is named or lagged residency was, since "auto" for both measured faster without."""
    if stage_slots == 0 or prefetch == "off":
        return False
    return not lagged or prefetch in NAMED_PREDICTORS or residency == "lagged"
