"""The GPU tests' counters (tests/gpu_counts.py), checked on the CPU with stand-ins for CUDA's sync
warnings and allocation statistics."""

from __future__ import annotations

import warnings

import torch

from gpu_counts import InsideModules, syncs


class Noisy(torch.nn.Module):
    """Warns `syncs` times as CUDA's sync debug mode would and allocates `allocs` times."""

    def __init__(self, syncs: int, allocs: int, ledger: list[int]):
        super().__init__()
        self.syncs, self.allocs, self.ledger = syncs, allocs, ledger

    def forward(self, x):
        for _ in range(self.syncs):
            warnings.warn("called a synchronizing CUDA operation")
        self.ledger[0] += self.allocs
        return x


def test_counts_are_what_happened_inside_the_modules_only():
    ledger = [0]
    modules = [Noisy(1, 2, ledger), Noisy(0, 0, ledger), Noisy(2, 1, ledger)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with InsideModules(modules, caught, allocated=lambda: ledger[0]) as inside:
            for module in modules:
                module(torch.zeros(1))
            warnings.warn("a synchronizing call outside every module")
            ledger[0] += 5  # an allocation outside every module
        modules[0](torch.zeros(1))  # after the block: hooks removed, not counted
    assert inside.counts == {"syncs": 3, "allocations": 3, "calls": 3}
    assert syncs(caught) == 5 and ledger[0] == 10
