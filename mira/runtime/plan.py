"""A loaded model's slot plan: the budget in bytes (given, a share of the experts, or the device's
free memory) less the reserve measured on the model, in expert slots (mira.cache.budget)."""

from __future__ import annotations

import torch

from mira.cache.budget import SlotPlan, plan_slots, share_shortfall, share_slots
from mira.errors import MiraError
from mira.models.kvcache import kv_values_per_token
from mira.runtime.config import RuntimeConfig, budget_share
from mira.store.store import ExpertStore

FREE_MEMORY_MARGIN = 1 << 30  # left to the CUDA context, allocator fragmentation and other processes
ACTIVATION_WORKSPACE = 256 << 20


def slot_plan(config: RuntimeConfig, hf_model, store: ExpertStore, max_context: int) -> SlotPlan | None:
    """The slots of `config.vram_budget` in bytes (on CUDA without one: the free memory less a margin);
    None on the CPU without a budget, where experts are read in place."""
    device = torch.device(config.device)
    budget = config.vram_budget
    if budget is None:
        if device.type == "cpu":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        budget = free + allocated - FREE_MEMORY_MARGIN
    non_expert, kv_bytes, workspace = reserve(device, hf_model, store, max_context)
    return plan_slots(budget, non_expert, kv_bytes, workspace, store.blob_bytes, store.num_experts,
                      store.num_layers * store.num_experts, max_context)


def reserve(device: torch.device, hf_model, store: ExpertStore, max_context: int) -> tuple[int, int, int]:
    """Bytes a budget holds before any expert slot: non-expert weights, KV cache, workspaces."""
    non_expert = sum(t.nbytes for t in hf_model.parameters()) + sum(t.nbytes for t in hf_model.buffers())
    kv_bytes = kv_values_per_token(hf_model.config) * max_context * hf_model.dtype.itemsize
    workspace = ACTIVATION_WORKSPACE if device.type == "cuda" else 0
    return non_expert, kv_bytes, workspace


def share_budget(text: str, hf_model, store: ExpertStore, max_context: int) -> int:
    """The budget that gives slots to a share of all experts (`text`, as "25%") beyond the reserve.

    Raises:
        MiraError: the share leaves fewer slots than one MoE layer has experts (all of a layer's
            must fit while it computes); the message gives the least share that fits.
    """
    total = store.num_layers * store.num_experts
    share = budget_share(text)
    shortfall = share_shortfall(share, total, store.num_experts)
    if shortfall:
        reason, least = shortfall
        raise MiraError(f"--vram-budget {reason}; pass --vram-budget {least}% or more")
    slots = share_slots(share, total)
    device = next(hf_model.parameters()).device
    return sum(reserve(device, hf_model, store, max_context)) + slots * store.blob_bytes
