"""Dependent launches: a decode's down launch started while its gate/up launch still runs.

On GPUs of compute capability 9.0 and later (and Triton 3.4 and later) a launch made with
`launch_pdl=True` may begin once every program of the launch before it has called `release`; its
programs call `await_primary` before they read anything that launch wrote, and the GPU holds them
there until it has finished and its writes are visible. What a program does before that overlaps
the previous launch and the gap between the two launches (the INT4 down launch asks L2 for its
weight bytes, `prefetch_l2`).

Where that pays is policy (`pays`); elsewhere (older GPUs, older Triton, the interpreter)
`supported_on` is False and the launches are ordinary ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FIRST_TRITON = (3, 4)  # the first Triton whose launcher passes launch_pdl


def supported_on(device: torch.device) -> bool:
    """Whether launches on `device` can be dependent ones: CUDA, compute capability 9.0 or later,
    Triton 3.4 or later, not the interpreter."""
    if device.type != "cuda" or triton.runtime.driver.active.get_current_target().backend != "cuda":
        return False
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    return version >= FIRST_TRITON and torch.cuda.get_device_capability(device)[0] >= 9


def pays(primary_programs: int, dependent_programs: int, sms: int) -> bool:
    """Whether to start the dependent launch early: only where both launches' programs fit on the
    GPU's SMs side by side. The dependent programs are placed on SMs when they start; where the
    primary's programs fill the GPU they crowd onto the few SMs that free up first and then run
    slower than an ordinary launch spread over every SM."""
    return primary_programs + dependent_programs <= sms


@triton.jit
def release(ON: tl.constexpr):
    """(The primary launch, at a program's start) let the next launch begin once every program has
    called this."""
    if ON:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def await_primary(ON: tl.constexpr):
    """(The dependent launch) wait until the launch before has finished and its writes are visible."""
    if ON:
        tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def prefetch_l2(ptrs, ON: tl.constexpr):
    """Ask L2 for the 128-byte lines holding the bytes at ptrs (a hint: nothing is loaded into
    registers and nothing waits)."""
    if ON:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
