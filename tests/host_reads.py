"""Counting reads of tensor values by the host: the CPU tests' stand-in for CUDA's sync debug mode
(on CUDA each such read of a device tensor waits for the device)."""

from __future__ import annotations

import threading

import torch

READS = ("tolist", "item", "cpu", "numpy", "__bool__")


def host_reads(monkeypatch, this_thread: bool = False) -> list[str]:
    """From now until `monkeypatch.undo()`: the name of every host read of tensor values, in order
    (`this_thread`: only those of the calling thread, not of worker threads meanwhile)."""
    reads: list[str] = []
    caller = threading.get_ident()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if not this_thread or threading.get_ident() == caller:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads
