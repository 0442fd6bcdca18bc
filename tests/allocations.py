"""Counting the tensors that operations create, on any device: the CPU tests' stand-in for
`torch.cuda.memory_stats()["allocation.all.allocated"]`.

Every aten operation is seen after autograd and composite decompositions; one whose output owns
storage that none of its inputs own made a new tensor (views, in-place and out= operations did
not). What a kernel allocates inside itself is invisible here: the GPU tests measure that.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NewTensors(TorchDispatchMode):
    """Records the operations that create tensors while `counting` is true; `paused()` stops
    counting for a while (to leave out a callee measured elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            owned = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor)}
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in owned
                   for t in tree_flatten(out)[0]):
                self.ops.append(str(func))
        return out

    @contextlib.contextmanager
    def paused(self):
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting
