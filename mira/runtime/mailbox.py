"""Where a replayed decode step hands a layer's chosen misses to the CPU lanes and takes their sums back.

Inside a CUDA graph no Python runs, so the exchange goes through pinned memory. The step copies the
layer's hidden rows, routing weights and the experts the CPU computes (`ids`, -1 elsewhere) into
pinned buffers, writes the layer and token count into the header, then raises each lane's POST flag
with a stream memory operation: cuStreamWriteValue64, which comes after a memory barrier, so the
rows are there first. The lanes (mira.runtime.cpu_lanes) poll their flags, compute, write their
sums and raise DONE; the stream waits for every DONE (cuStreamWaitValue64), lowers it, and copies
the sums back. Both operations are captured into graphs as memory-operation nodes: no host function,
no CUDA callback thread, no host sync.

On the CPU (no graphs: CPU-only runs and tests) the caller plays the device's part itself: it fills
the buffers, raises the flags and polls for DONE.

T tokens of a decode call (at most DECODE_TOKENS), K routed per token, H hidden, L lanes.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import torch

from mira.errors import MiraError
from mira.kernels import DECODE_TOKENS

POST, DONE = 0, 1  # a lane's flags: the step raises POST, the lane raises DONE
LAYER, TOKENS = 0, 1  # the header's fields
CU_STREAM_WAIT_VALUE_EQ = 0x1  # cuStreamWaitValue64: until *address == value
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # cuStreamWriteValue64: a memory barrier before the write
CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V2 = 122


class StreamMemOps:
    """The driver's 64-bit stream memory operations on the current CUDA device.

    Raises:
        MiraError: the device does not take them.
    """

    def __init__(self) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, supported = ctypes.c_int(), ctypes.c_int()
        failed = cuda.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()) or cuda.cuDeviceGetAttribute(
            ctypes.byref(supported), CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V2, device)
        if failed or not supported.value:
            raise MiraError("this GPU does not take 64-bit stream memory operations, which --cpu-experts graph "
                            "needs; pass --cpu-experts split or off")
        self._write, self._wait = cuda.cuStreamWriteValue64_v2, cuda.cuStreamWaitValue64_v2
        for op in (self._write, self._wait):  # (stream, address, value, flags)
            op.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            op.restype = ctypes.c_int  # CUresult

    def write(self, address: int, value: int) -> None:
        """Enqueue on the current stream: *address = value, once the work before it is visible."""
        self._check("cuStreamWriteValue64", self._write(self._stream(), address, value, CU_STREAM_WRITE_VALUE_DEFAULT))

    def wait(self, address: int, value: int) -> None:
        """Enqueue on the current stream: hold until *address == value."""
        self._check("cuStreamWaitValue64", self._wait(self._stream(), address, value, CU_STREAM_WAIT_VALUE_EQ))

    @staticmethod
    def _stream() -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    @staticmethod
    def _check(name: str, status: int) -> None:
        if status:
            raise RuntimeError(f"{name} failed with CUresult {status}")


class Mailbox:
    """The pinned buffers and flags of the exchange, made once for a model's decode calls.

    Args:
        lanes: L.
        hidden_size: H.
        top_k: K.
        dtype: the hidden rows' dtype.
        weights_dtype: the routing weights' dtype.
        device: where the layers run (CUDA: pinned buffers and stream memory operations).

    Attributes:
        header: int64 [2]: the layer's position and its tokens.
        rows: [DECODE_TOKENS, H] hidden rows.
        ids: int64 [DECODE_TOKENS, K]: the routed expert where the CPU computes it, else -1.
        weights: [DECODE_TOKENS, K] routing weights.
        out: float32 [DECODE_TOKENS, L, H]: each lane's sum over its experts (token-major, so a
            call's first T rows are one contiguous block for the copy back).
        flags: int64 [L, 2]: each lane's POST and DONE.
    """

    def __init__(self, lanes: int, hidden_size: int, top_k: int, dtype: torch.dtype, weights_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        T = DECODE_TOKENS
        self.header = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)
        self.rows = torch.zeros(T, hidden_size, dtype=dtype, pin_memory=cuda)
        self.ids = torch.full((T, top_k), -1, dtype=torch.int64, pin_memory=cuda)
        self.weights = torch.zeros(T, top_k, dtype=weights_dtype, pin_memory=cuda)
        self.out = torch.zeros(T, lanes, hidden_size, dtype=torch.float32, pin_memory=cuda)
        self.flags = torch.zeros(lanes, 2, dtype=torch.int64, pin_memory=cuda)
        self.lanes = lanes
        self._ops = StreamMemOps() if cuda else None
        self._sums = torch.zeros(T, lanes, hidden_size, device=self.device) if cuda else None  # [T, L, H]
        self._sum = torch.zeros(T, hidden_size, device=self.device) if cuda else None  # [T, H]

    def release(self) -> None:
        """Raise every lane's DONE from the host: a stream held by `collect` goes on (the way out of
        an exchange the lanes never answered)."""
        self.flags[:, DONE] = 1

    def flag(self, lane: int, which: int) -> int:
        """The address of one of a lane's flags."""
        return self.flags.data_ptr() + (lane * 2 + which) * self.flags.element_size()

    def fits(self, hidden: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
        """Whether a call's rows fit these buffers."""
        return (hidden.shape[0] <= self.rows.shape[0] and hidden.shape[1] == self.rows.shape[1]
                and hidden.dtype == self.rows.dtype and top_k_weights.shape[1] == self.weights.shape[1]
                and top_k_weights.dtype == self.weights.dtype)

    def post(self, layer_position: int, hidden: torch.Tensor, ids: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Hand the lanes one layer call: its rows, the CPU's experts (`ids` [T, K], -1 elsewhere)
        and weights copied here, then every lane's POST raised (on CUDA, all enqueued on the current
        stream, without a host sync)."""
        T = hidden.shape[0]
        for dst, src in ((self.rows, hidden), (self.ids, ids), (self.weights, top_k_weights)):
            dst[:T].copy_(src, non_blocking=True)
        if self._ops is None:
            self.header[LAYER], self.header[TOKENS] = layer_position, T
            self.flags[:, POST] = 1
            return
        header, size = self.header.data_ptr(), self.header.element_size()
        self._ops.write(header + LAYER * size, layer_position)
        self._ops.write(header + TOKENS * size, T)
        for lane in range(self.lanes):
            self._ops.write(self.flag(lane, POST), 1)

    def collect(self, out: torch.Tensor, check: Callable[[], None] | None = None) -> torch.Tensor:
        """out [T, H] += the lanes' sums, once every lane has raised DONE (lowered again here): on
        CUDA enqueued on the current stream; on the CPU waited for, then `check` called (it raises
        a lane's error)."""
        T = out.shape[0]
        if self._ops is None:
            while not bool((self.flags[:, DONE] == 1).all()):
                time.sleep(0)
            self.flags[:, DONE] = 0
            if check is not None:
                check()
            return out.add_(self.out[:T].sum(1).to(out.dtype))
        for lane in range(self.lanes):
            self._ops.wait(self.flag(lane, DONE), 1)
            self._ops.write(self.flag(lane, DONE), 0)
        sums = self._sums[:T]
        sums.copy_(self.out[:T], non_blocking=True)  # contiguous: a pinned source, as capture needs
        return out.add_(torch.sum(sums, 1, out=self._sum[:T]))
