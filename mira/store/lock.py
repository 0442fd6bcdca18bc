"""One writer per store: an advisory lock file beside the store, held while a conversion or a
repair writes it, so that a second one waits instead of writing the same files at the same time.

The lock is `flock` on `.<name>.lock` in the store's parent directory. The kernel releases it when
its holder dies, even by SIGKILL, so a killed conversion never blocks the next one; the holder
deletes the file when it is done, and a waiter that finds its file deleted or replaced takes the
lock again on the new file (two processes never both hold a lock on different files).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from mira.errors import MiraError


def lock_path(store: Path) -> Path:
    return store.with_name(f".{store.name}.lock")


@contextlib.contextmanager
def store_lock(store: Path) -> Iterator[None]:
    """Hold the store's lock while inside; wait (saying so once, on stderr) while another holds it.

    Raises:
        MiraError: the store's parent directory cannot be created or written.
    """
    path = lock_path(store)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MiraError(f"cannot create {path.parent}: {error.strerror}; pass a path in a writable directory") from None
    said = False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise MiraError(f"cannot write in {path.parent}: {error.strerror}; pass a path in a writable "
                            "directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not said:
                print(f"mira: another process is writing {store}; waiting for it to finish", file=sys.stderr)
                said = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder before us deleted the file we waited on: lock the current one
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)
