"""How expert bytes move from the host store to where the kernel reads them (paper IV-F).

On CUDA there are two copy streams: on-demand misses go on the highest-priority one, so they never
queue behind prefetches, and prefetches on the other. Every row a copy lands in (a slot, or a
transient row for an expert served without admission) has an event: a copy first waits for the
compute already queued (a row is overwritten only after earlier kernels have read it), and the
compute stream waits on the row's event before a kernel reads it. Both waits happen on the GPU: no
host sync. Copies into one row are ordered across the two streams by the same event, so a late
prefetch can never land over a newer copy into its row. Work that must follow a copy (lagged
residency's table entry for the row: mira.cache.lagged) goes on the copy's stream before the event,
so waiting on the event covers it too. On the CPU, copies are memcpy and the store's blobs are read
in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Transfer:
    def __init__(self, device: torch.device, num_slots: int, blob_bytes: int, experts_per_layer: int):
        self.device = device
        self._cuda = device.type == "cuda"
        self._next_transient = 0
        if self._cuda:
            low, high = torch.cuda.Stream.priority_range()
            self.demand_stream = torch.cuda.Stream(device=device, priority=high)
            self.prefetch_stream = torch.cuda.Stream(device=device, priority=min(high + 1, low))
            # rows for experts served without admission into a slot
            self._transient = torch.empty(experts_per_layer, blob_bytes, dtype=torch.uint8, device=device)
            self._events = [torch.cuda.Event() for _ in range(num_slots + experts_per_layer)]  # slots, then transient
            self._num_slots = num_slots

    def load(self, src: torch.Tensor, dst: torch.Tensor, slot: int, prefetch: bool = False,
             then: Callable[[], None] | None = None) -> torch.Tensor:
        """Copy host blob `src` into slot row `dst` (asynchronously on CUDA); returns `dst`.

        The copy waits for everything already enqueued on the current (compute) stream. `then`, if
        given, is called with the copy's stream current, right after the copy is enqueued and before
        the row's event is recorded: what it enqueues runs once the bytes have landed, and `ready`
        waits for it too.
        """
        if not self._cuda:
            dst.copy_(src)
            if then is not None:
                then()
            return dst
        stream = self.prefetch_stream if prefetch else self.demand_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        stream.wait_event(self._events[slot])  # the row's previous copy, maybe on the other stream, lands first
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            if then is not None:
                then()
            self._events[slot].record(stream)
        return dst

    def ready(self, slot: int) -> None:
        """The current (compute) stream waits until slot `slot`'s last copy, and what followed it
        on the copy stream, has landed (no host sync)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._events[slot])

    def begin_layer(self) -> None:
        self._next_transient = 0

    def serve_from_host(self, src: torch.Tensor) -> torch.Tensor:
        """A blob the kernel can read for an expert that is not admitted into a slot."""
        if not self._cuda:
            return src
        row = self._next_transient
        self._next_transient += 1
        blob = self.load(src, self._transient[row], self._num_slots + row)
        self.ready(self._num_slots + row)
        return blob

    @staticmethod
    def workspace_bytes(device: torch.device, blob_bytes: int, experts_per_layer: int) -> int:
        """Device bytes of the transient rows a Transfer on `device` allocates."""
        return experts_per_layer * blob_bytes if device.type == "cuda" else 0
