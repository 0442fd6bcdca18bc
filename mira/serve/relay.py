"""Items handed from a producing thread to an event loop in batches.

The producer only appends under a lock; it wakes the loop when the consumer waits with nothing to
take, and otherwise at most once per interval, or at once when it flushes. A generation that makes
a token every few milliseconds thus pays no cross-thread call per token, and the loop, which holds
the GIL while it encodes and sends, runs once per batch instead of once per token.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Generic, TypeVar

Item = TypeVar("Item")
STREAM_INTERVAL_S = 0.02  # the server's default: finer than a reader notices, several tokens apart on a GPU


class Relay(Generic[Item]):
    """A producer thread's items, taken in order on `loop` at most once per `interval_s` seconds
    unless the producer flushes (interval 0: every put wakes the consumer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float):
        self._loop = loop
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._items: list[Item] = []
        self._flushed = False  # the producer asked for what it put to go out now
        self._due = 0.0  # loop time before which a take waits, unless flushed
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits
        self._wake_on_put = False  # whether a put (not only a flush) ends the consumer's wait

    def put(self, item: Item) -> None:
        """Append `item` (from any thread)."""
        with self._lock:
            self._items.append(item)
            waiter = self._waiter if self._wake_on_put else None
            if waiter is not None:
                self._waiter = None
        if waiter is not None:
            self._wake(waiter)

    def flush(self) -> None:
        """Let what was put go to the consumer now, its interval notwithstanding (from any thread)."""
        with self._lock:
            self._flushed = True
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._wake(waiter)

    async def take(self) -> list[Item]:
        """Every item put since the last take, in order (at least one); waits for the first, and
        until `interval_s` after the last take returned unless the producer flushes."""
        while True:
            with self._lock:
                now = self._loop.time()
                if self._items and (self._flushed or now >= self._due):
                    items, self._items, self._flushed = self._items, [], False
                    self._due = now + self._interval_s
                    return items
                pausing = not self._flushed and now < self._due
                self._wake_on_put = not pausing
                self._waiter = waiter = self._loop.create_future()
            timer = self._loop.call_later(self._due - now, _resolve, waiter) if pausing else None
            try:
                await waiter
            finally:
                if timer is not None:
                    timer.cancel()
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None

    def _wake(self, waiter: asyncio.Future) -> None:
        try:
            self._loop.call_soon_threadsafe(_resolve, waiter)
        except RuntimeError:  # the loop has closed: the server is shutting down and nobody listens
            pass


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():  # a timer and a wake may both come; the consumer may have been cancelled
        waiter.set_result(None)
