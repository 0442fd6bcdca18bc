"""What the GPU tests count inside Mira's experts modules during a decode step: host syncs (CUDA's
sync debug mode turns each into a warning) and caching-allocator allocations, per module call."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch


@contextlib.contextmanager
def sync_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """CUDA's sync debug mode at "warn" while the block runs; yields the warnings caught so far."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def syncs(caught: Sequence[warnings.WarningMessage]) -> int:
    """How many of `caught` report a host sync."""
    return sum("synchroniz" in str(w.message) for w in caught)


def cuda_allocations() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


class InsideModules:
    """While entered: per call of any of `modules` (from its forward pre-hook to its forward hook),
    the host syncs among `caught` and the allocations `allocated()` counted, summed in `counts`."""

    def __init__(self, modules: Sequence[torch.nn.Module], caught: list, allocated: Callable[[], int] = cuda_allocations):
        self.modules, self.caught, self.allocated = modules, caught, allocated
        self.counts = {"syncs": 0, "allocations": 0, "calls": 0}
        self._marks: dict[str, int] = {}
        self._hooks: list = []

    def _before(self, module, args) -> None:
        self._marks = {"warnings": len(self.caught), "allocations": self.allocated()}

    def _after(self, module, args, output) -> None:
        self.counts["syncs"] += syncs(self.caught[self._marks["warnings"]:])
        self.counts["allocations"] += self.allocated() - self._marks["allocations"]
        self.counts["calls"] += 1

    def __enter__(self) -> InsideModules:
        self._hooks = [hook for m in self.modules
                       for hook in (m.register_forward_pre_hook(self._before), m.register_forward_hook(self._after))]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
