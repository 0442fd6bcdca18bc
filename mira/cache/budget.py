"""From a byte budget to a number of expert slots (paper IV-C, DESIGN.md 2.5).

reserve = non-expert weights + KV cache for the maximum context + workspaces; what is left of the
budget, divided by the expert blob size, is the number of slots. A budget that leaves room for
fewer slots than one MoE layer has experts is refused: every expert of a layer call must be
resident while the layer computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mira.errors import MiraError

GiB = 1 << 30
UNITLESS_BELOW = 1 << 10  # a budget of fewer bytes was most likely meant in GiB or MiB, written without a unit


class BudgetTooSmall(MiraError):
    """A budget below what one MoE layer needs; `shortfall` says why and `needed` what would run, so
    that each front end names its own option (the message names `mira generate`'s)."""

    def __init__(self, shortfall: str, needed: int, budget: int, smaller_context: bool):
        self.shortfall, self.needed = shortfall, needed
        super().__init__(
            f"{shortfall}; pass --vram-budget of at least {format_size(needed, up=True)}"
            + (" or a smaller --max-context" if smaller_context else "")
            + ("; a size without a unit is bytes: write 12GiB, not 12" if budget < UNITLESS_BELOW else ""))


@dataclass(frozen=True)
class SlotPlan:
    budget_bytes: int
    reserve_bytes: int
    slot_bytes: int
    slots: int


def plan_slots(budget: int, non_expert_bytes: int, kv_bytes: int, workspace_bytes: int, blob_bytes: int,
               experts_per_layer: int, total_experts: int, max_context: int) -> SlotPlan:
    """Expert slots that fit in `budget` bytes (never more than the model has experts).

    Raises:
        MiraError: the budget is below what the non-expert weights, KV cache, workspaces and one
            layer of experts need; the message says how much is needed and what to change.
    """
    reserve = non_expert_bytes + kv_bytes + workspace_bytes
    needed = reserve + experts_per_layer * blob_bytes
    if budget < needed:
        given, wanted = format_size(budget), format_size(needed, up=True)
        if given == wanted:  # two decimals cannot tell them apart
            given, wanted = f"{budget} B", f"{needed} B"
        raise BudgetTooSmall(
            f"the budget of {given} is below the {wanted} needed "
            f"({format_size(non_expert_bytes)} non-expert weights, {format_size(kv_bytes)} KV cache for "
            f"{max_context} tokens, {format_size(workspace_bytes)} workspaces, {experts_per_layer} expert slots of "
            f"{format_size(blob_bytes)})", needed, budget, smaller_context=kv_bytes > 0)
    slots = min((budget - reserve) // blob_bytes, total_experts)
    return SlotPlan(budget, reserve, blob_bytes, int(slots))


def share_slots(share: float, total_experts: int) -> int:
    """Slots a budget given as a share of all experts (0.25 for "25%") asks for: at least one."""
    return max(1, round(share * total_experts))


def share_shortfall(share: float, total_experts: int, per_layer: int) -> tuple[str, int] | None:
    """Why a share of all experts cannot run, and the least whole percentage that can: its slots
    are fewer than one MoE layer's experts, which must all fit while the layer computes. None: the
    share runs."""
    slots = share_slots(share, total_experts)
    if slots >= per_layer:
        return None
    least = next(percent for percent in range(1, 101) if share_slots(percent / 100, total_experts) >= per_layer)
    return (f"{share * 100:g}% gives slots for {slots} of the model's {total_experts} experts, fewer than the "
            f"{per_layer} of one MoE layer, which must all fit while it computes"), least


def format_size(nbytes: int, up: bool = False) -> str:
    """Bytes as GiB, MiB or KiB (the largest not above them), two decimals, or under 1 KiB as bytes;
    rounded up when `up` (for a minimum to ask for)."""
    if nbytes < 1 << 10:
        return f"{nbytes} B"
    unit, name = next((unit, name) for unit, name in ((GiB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
                      if nbytes >= unit)
    value = nbytes / unit
    if up:
        value = math.ceil(value * 100) / 100
    return f"{value:.2f} {name}"


def parse_size(text: str) -> int:
    """'24GiB', '24G', '512MiB', '1.5GB' or a plain number of bytes -> bytes (powers of 1024).

    Raises:
        MiraError: unreadable size.
    """
    units = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = cleaned, ""
    if cleaned and cleaned[-1] in units:
        number, unit = cleaned[:-1], cleaned[-1]
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise MiraError(f"cannot read the size {text!r}; write it like 24GiB, 512MiB or 8G") from None
    if not math.isfinite(value) or value < 1:
        raise MiraError(f"the size {text!r} must be a finite number of at least 1 byte, like 24GiB")
    return int(value)
