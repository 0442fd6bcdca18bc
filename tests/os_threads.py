"""This process's OS threads, as Linux lists them, and a fresh thread to run something in."""

from __future__ import annotations

import os
import threading
import time


def in_a_thread(fn):
    """fn's result (or its error, raised here), run in a fresh thread (whose torch thread count and
    OpenMP team are its own)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # raised on the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def os_threads() -> int:
    """This process's OS threads now."""
    return len(os.listdir("/proc/self/task"))


def settled_threads(expected: int, timeout: float = 5.0) -> int:
    """This process's OS threads once they reach `expected` (exiting threads leave the list a moment late)."""
    deadline = time.monotonic() + timeout
    while (count := os_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count
