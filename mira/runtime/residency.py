"""Whether decode layers under a budget run lagged or inline (`load`'s `residency`; mira.cache.lagged).

Lagged, no MoE layer syncs with the host, so a decode step can be replayed as a CUDA graph; an
expert the policy admits after a miss crosses PCIe twice (read by the kernel, then copied into its
slot), which the mira policy weighs before admitting (mira.cache.policy), and staging ahead is
decided on the device (mira.cache.staging). Inline, every MoE layer costs one host sync and the
host's policy work, and a miss crosses once. "auto" lags on CUDA whenever the fused kernels can
read missed experts from the pinned store: with cost-aware admission it measured at least as fast
as inline for large experts too (benchmarks/results/bench-mixtral-8x7b-replay.json), and much
faster for small ones, whose inline steps are host-bound. On the CPU, where there is no PCIe, it
lags only the policies that never admit a miss (static, on-demand), which lose nothing by it.
Nothing lags when every expert fits (those layers never sync anyway). Whether a lagged model
stages is `stages`: with a predictor named, or with residency "lagged" asked for, but not for
`prefetch="auto"` under "auto" residency, where staging did not pay.
"""

from __future__ import annotations

import torch

from mira.config import RESIDENCY
from mira.errors import MiraError

NAMED_PREDICTORS = ("trained", "gate")


def lags(residency: str, *, admits_misses: bool, under_budget: bool, device: torch.device, fused_kernels: bool) -> bool:
    """Whether decode layers run lagged.

    Args:
        residency: "auto", "lagged" or "inline".
        admits_misses: whether the residency policy ever admits a miss (mira.cache.policy.Policy).
        under_budget: whether some expert has no slot.
        device: where the model runs.
        fused_kernels: whether the expert FFN reads blobs by address (TritonMoEFFN).

    Raises:
        MiraError: an unknown residency.
    """
    if residency not in RESIDENCY:
        raise MiraError(f"unknown residency {residency!r}; choose one of {', '.join(RESIDENCY)}")
    possible = under_budget and (device.type == "cpu" or fused_kernels)
    if not possible or residency == "inline":
        return False
    return residency == "lagged" or not admits_misses or device.type == "cuda"


def stages(prefetch: str, residency: str, lagged: bool, stage_slots: int) -> bool:
    """Whether the model stages predicted experts: where the policy has STAGE slots and a predictor
    is asked for; under lagged residency (on the device, mira.cache.staging) only when the
    predictor is named or lagged residency was, since "auto" for both measured faster without."""
    if stage_slots == 0 or prefetch == "off":
        return False
    return not lagged or prefetch in NAMED_PREDICTORS or residency == "lagged"
