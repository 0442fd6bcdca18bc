"""The address table the fused kernels read, filled per layer call without allocating (DESIGN.md 2.8).

`TritonMoEFFN.forward_bases` takes one int64 base address per expert of the layer (0 for an expert
with no blob), on the device. `TritonMoEFFN.__call__` builds that table from a list of blobs,
checking every blob and staging the table in a fresh pinned tensor: some 70-100 us of Python per
call. The runtime instead keeps one `AddressTable` per MoE layer: the addresses of the routed
experts are written into a preallocated host array and moved by one non-blocking copy into a
preallocated device table; see `benchmarks/address_table.py` for the host time of both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AddressTable:
    """The blob addresses of one MoE layer's experts: `device_table` int64 [E].

    On CUDA the host array is pinned, so its copy is asynchronous; an event recorded after the
    copy guards the array, which `fill` rewrites only once the copy has read it. In the runtime it
    never waits: every layer call syncs with the host once, long after its previous copy.

    `fill` trusts its blobs, as the runtime's are: rows of `layout.nbytes` bytes (a multiple of
    128) in uint8 buffers Mira allocated (device slots, transient rows, the pinned store). Blobs
    from elsewhere go through `TritonMoEFFN.__call__`, which checks each one.

    Args:
        num_experts: E.
        device: where the kernels run.
    """

    def __init__(self, num_experts: int, device: torch.device | str):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(num_experts, dtype=torch.int64, pin_memory=cuda)  # [E]
        self._addresses = self._host.numpy()  # writing a numpy element costs ~0.1 us, a tensor element ~2 us
        self.device_table = torch.zeros(num_experts, dtype=torch.int64, device=self.device) if cuda else self._host
        self._copied = torch.cuda.Event() if cuda else None

    def fill(self, blobs: Sequence[torch.Tensor | None], experts: Sequence[int]) -> torch.Tensor:
        """The device table holding the blob address of each expert in `experts`, 0 for every other.

        Args:
            blobs: length E, the blob of every expert in `experts` (e.g. `ExpertCache.fetch`'s list).
            experts: the routed experts.

        Returns:
            `device_table`, whose copy is enqueued on the current stream (no host sync).
        """
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous copy has not read the host array yet
        addresses = self._addresses
        addresses.fill(0)
        for expert in experts:
            addresses[expert] = blobs[expert].data_ptr()
        if self._copied is not None:
            self.device_table.copy_(self._host, non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))
        return self.device_table
