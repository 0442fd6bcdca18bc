"""Counting reads of tensor values by the host: the CPU tests' stand-in for CUDA's sync debug mode
(on CUDA each such read of a device tensor waits for the device)."""

from __future__ import annotations

import torch

READS = ("tolist", "item", "cpu", "numpy", "__bool__")


def host_reads(monkeypatch) -> list[str]:
    """From now until `monkeypatch.undo()`: the name of every host read of tensor values, in order."""
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads
