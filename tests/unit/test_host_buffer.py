"""The store's host memory (mira.store.store.host_buffer): private pages of its own, advised for
huge pages, as the kernel records them in /proc/self/smaps."""

import sys
from pathlib import Path

import pytest
import torch

from mira.store.store import host_buffer


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` in this process."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps and huge pages are Linux's")
def test_host_buffer_is_private_and_asks_for_huge_pages():
    buffer = host_buffer((3, 1 << 20))
    flags = vm_flags(buffer.data_ptr())
    assert "hg" in flags  # MADV_HUGEPAGE
    assert "sh" not in flags  # private: a shared anonymous mapping is shmem, which gets no huge pages by default
    assert buffer.shape == (3, 1 << 20) and buffer.dtype == torch.uint8 and int(buffer.sum()) == 0
