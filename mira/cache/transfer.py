"""How expert bytes move from the host store into slots (paper IV-F).

On CUDA there are two copy streams: copies into slots (misses the policy admits) go on the
highest-priority one, so they never queue behind prefetches, and staging's copies go on the other
(mira.cache.staging). Every slot has an event: a copy first waits for the compute already queued (a
row is overwritten only after earlier kernels have read it), and the compute stream waits on the
slot's event where a kernel must read the new bytes. Both waits happen on the GPU: no host sync.
Work that must follow a copy (the slot's table entry: mira.cache.tables) goes on the copy's stream
before the event, so waiting on the event covers it too. On the CPU, copies are memcpy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Transfer:
    def __init__(self, device: torch.device, num_slots: int):
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            low, high = torch.cuda.Stream.priority_range()
            self.demand_stream = torch.cuda.Stream(device=device, priority=high)
            self.prefetch_stream = torch.cuda.Stream(device=device, priority=min(high + 1, low))
            self._events = [torch.cuda.Event() for _ in range(num_slots)]

    def load(self, src: torch.Tensor, dst: torch.Tensor, slot: int, then: Callable[[], None] | None = None) -> None:
        """Copy host blob `src` into slot row `dst` (asynchronously on CUDA).

        The copy waits for everything already enqueued on the current (compute) stream. `then`, if
        given, is called with the copy's stream current, right after the copy is enqueued and before
        the slot's event is recorded: what it enqueues runs once the bytes have landed, and `ready`
        waits for it too.
        """
        if not self._cuda:
            dst.copy_(src)
            if then is not None:
                then()
            return
        stream = self.demand_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            if then is not None:
                then()
            self._events[slot].record(stream)

    def ready(self, slot: int) -> None:
        """The current (compute) stream waits until slot `slot`'s last copy, and what followed it
        on the copy stream, has landed (no host sync)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[slot])
