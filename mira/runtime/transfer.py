"""How expert bytes move from the host store to where the kernel reads them (paper IV-F).

On CUDA, copies run on a high-priority copy stream. Before a layer's copies the copy stream waits
for the compute stream (a slot may be overwritten only after earlier kernels have read it); after
them the compute stream waits for the copy stream, so the kernel reads complete blobs. Both waits
happen on the GPU: no host sync. On the CPU, copies are memcpy and the store's blobs are read in
place.
"""

from __future__ import annotations

import torch


class Transfer:
    def __init__(self, device: torch.device, blob_bytes: int, experts_per_layer: int):
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            self.copy_stream = torch.cuda.Stream(device=device, priority=-1)
            # rows for experts served without admission (until the kernel reads pinned memory directly)
            self._transient = torch.empty(experts_per_layer, blob_bytes, dtype=torch.uint8, device=device)
            self._next_transient = 0

    def begin_layer(self) -> None:
        if self._cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._next_transient = 0

    def end_layer(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def load(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Copy host blob `src` into device row `dst` (asynchronously on CUDA); returns `dst`."""
        if self._cuda:
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
        return dst

    def serve_from_host(self, src: torch.Tensor) -> torch.Tensor:
        """A blob the kernel can read for an expert that is not admitted into a slot."""
        if not self._cuda:
            return src
        row = self._transient[self._next_transient]
        self._next_transient += 1
        return self.load(src, row)

    @property
    def workspace_bytes(self) -> int:
        return self._transient.nbytes if self._cuda else 0
