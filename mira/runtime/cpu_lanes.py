"""Threads that compute the misses a replayed decode step hands them through a mailbox (DESIGN.md 2.8).

A small expert (a few MB) is too little work to keep every CPU thread busy at once, so the CPU's
share of a layer is dealt to L lanes: each a Python thread with threads / L torch threads of its
own (mira.runtime.cpu_worker says why a thread's count is its own), computing its experts one after
another, all lanes at once. Lane i takes the i-th, (i+L)-th, ... of the layer's CPU experts in
ascending order and writes its sum into its row of the mailbox.

A lane polls its POST flag (mira.runtime.mailbox), letting the GIL go at each look; a step that
replays from a CUDA graph has no Python of its own to wake it. While posts keep coming (decoding)
it looks again at once; after `IDLE_S` without one it looks every `DOZE_S`, so an idle model costs
the CPU next to nothing and the first layer of a new step waits at most that long. A lane that
fails writes zeros and raises DONE all the same (the stream never waits for good); `check` raises
its error on the caller's thread.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence

import torch

from mira.kernels.cpu_experts import CpuExpertFFN
from mira.runtime.mailbox import DONE, LAYER, POST, TOKENS, Mailbox
from mira.runtime.threads import free_idle_team

IDLE_S = 0.05  # seconds without a post after which a lane stops looking at once
DOZE_S = 1e-3  # between looks after that


class CpuLanes:
    """L lanes serving one mailbox from the store's host blobs.

    Args:
        make_ffn: a fresh CPU executor of the store's layout (one per lane: each keeps its own views).
        blobs: per MoE layer, the host blob of every expert.
        mailbox: where the layer calls come from.
        threads: torch threads in all, dealt evenly to the lanes (at least one each).

    Attributes:
        threads: each lane's torch threads.
        served: per MoE layer, the experts the lanes have computed.
        tokens: per MoE layer, the routed tokens of those experts (a token and one of its experts each).
        busy_s: per MoE layer, the seconds each lane spent from a post seen to its DONE, summed.
    """

    def __init__(self, make_ffn: Callable[[], CpuExpertFFN], blobs: Sequence[Sequence[torch.Tensor]],
                 mailbox: Mailbox, threads: int) -> None:
        lanes = mailbox.lanes
        if threads < lanes:
            raise ValueError(f"{lanes} CPU lanes need at least as many threads, not {threads}")
        self.threads = threads // lanes
        self.mailbox = mailbox
        self.served = [0] * len(blobs)
        self.tokens = [0] * len(blobs)
        self.busy_s = [0.0] * len(blobs)
        self._blobs = blobs
        self._error: BaseException | None = None
        self._closing = False
        self._lock = threading.Lock()  # the counters, updated by every lane
        self._threads = [threading.Thread(target=self._serve, args=(lane, make_ffn()), name=f"mira-cpu-lane-{lane}",
                                          daemon=True) for lane in range(lanes)]
        for thread in self._threads:
            thread.start()
        free_idle_team()  # the caller's, beside which the lanes' threads would sleep between operations

    def check(self) -> None:
        """Raise the first error a lane met (once)."""
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("a CPU lane failed while computing its experts") from error

    def close(self) -> None:
        """Stop the lanes once they are through with what they hold (a lane closing them, as a
        collection on its thread may, just stops)."""
        self._closing = True
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _serve(self, lane: int, ffn: CpuExpertFFN) -> None:
        torch.set_num_threads(self.threads)
        box = self.mailbox
        post = ctypes.c_int64.from_address(box.flag(lane, POST))
        done = ctypes.c_int64.from_address(box.flag(lane, DONE))
        last = time.perf_counter()
        while not self._closing:
            if post.value != 1:
                time.sleep(0 if time.perf_counter() - last < IDLE_S else DOZE_S)  # lets the GIL go
                continue
            post.value = 0
            begin = last = time.perf_counter()
            layer, tokens = int(box.header[LAYER]), int(box.header[TOKENS])
            out = box.out[:tokens, lane]
            try:
                ids = box.ids[:tokens]
                routes = ids.tolist()  # [T, K]
                mine = sorted({e for row in routes for e in row if e >= 0})[lane::box.lanes]
                ffn(box.rows[:tokens], ids, box.weights[:tokens], self._blobs[layer], mine, out=out)
                routed = sum(e in mine for row in routes for e in row)
            except BaseException as error:  # raised on the caller's thread by `check`
                out.zero_()
                self._error = self._error or error
                mine, routed = [], 0
            with self._lock:
                self.served[layer] += len(mine)
                self.tokens[layer] += routed
                self.busy_s[layer] += time.perf_counter() - begin
            done.value = 1  # after the sum: x86 stores become visible in order
