"""The baselines a user would pick instead of Mira, built from the same config (paper V).

- transformers with every weight on the GPU in bf16 (no offloading; only where it fits);
- transformers + accelerate `device_map` offload with `max_memory` set to the budget: layers that
  do not fit stay in (pageable) host memory and are copied to the GPU by accelerate's hooks at
  every forward pass.

One random bf16 model serves both: built on the GPU (transformers' own initialisation), timed
there, then moved to host memory and dispatched once per budget.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from mira.models.registry import adapter_for
from mira.runtime.config import default_dtype
from mira.store.layout import ExpertLayout

HOST_MARGIN = 8 << 30  # host memory left to the process and the system
DEVICE_MARGIN = 2 << 30


def compute_dtype(config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """The dtype `mira.load` computes this model in on `device` (default_dtype: bf16, but float32 for
    small experts on the CPU), in which the bench builds Mira's model and the baselines alike."""
    spec = adapter_for(config).spec
    weights = ExpertLayout("int8-shared", spec.hidden, spec.intermediate, gated=spec.gated).weights
    return getattr(torch, default_dtype(device.type, weights))


def parameter_bytes(config: PretrainedConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the full model's weights, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return fits_in_host(nbytes)
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes + DEVICE_MARGIN <= free


def fits_in_host(nbytes: int) -> bool:
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return nbytes + HOST_MARGIN <= available


def full_model(config: PretrainedConfig, device: torch.device, seed: int = 0):
    """The whole model with random weights on `device` (in `compute_dtype`), with transformers'
    default experts implementation."""
    dtype = compute_dtype(config, device)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@contextlib.contextmanager
def offloaded(model, budget_bytes: int, device: torch.device) -> Iterator[torch.nn.Module]:
    """`model` (in host memory) dispatched by accelerate with `max_memory` {device: budget}; undone on exit.

    The host tensors are kept by reference and assigned back afterwards, so the next budget
    starts from the same weights without a second host copy.
    """
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_module

    host_state = dict(model.state_dict(keep_vars=True))
    index = device.index if device.index is not None else torch.cuda.current_device()
    device_map = infer_auto_device_map(model, max_memory={index: budget_bytes, "cpu": 1 << 50},
                                       no_split_module_classes=model._no_split_modules, dtype=model.dtype)
    dispatch_model(model, device_map=device_map, main_device=index)
    try:
        yield model
    finally:
        remove_hook_from_module(model, recurse=True)
        model.load_state_dict({name: tensor.data for name, tensor in host_state.items()}, assign=True)
        torch.cuda.empty_cache()


def device_map_summary(model) -> dict[str, int]:
    """Parameters per device after dispatch (host-offloaded ones show as 'meta' or 'cpu')."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        counts[str(p.device)] = counts.get(str(p.device), 0) + p.numel()
    return counts
