"""Small file utilities shared by conversion and loading: checksums and atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from mira.errors import MiraError

CHUNK = 16 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of `path`, the `what` a command was given (e.g. "prompt file"), less a byte-order
    mark that some editors write first.

    Raises:
        MiraError: the file is unreadable or not UTF-8 text.
    """
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise MiraError(f"cannot read {what} {path} as UTF-8 text ({error}); pass a text file") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give a new file here (read once, at import)


def temporary_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in `path`'s directory, to be renamed over `path`: (descriptor, name). Its
    mode is what a file made by open() gets (mkstemp's own, owner-only, would pass on to `path`)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, FILE_MODE)
    return fd, tmp


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (the files renamed into it), to the disk, so that
    a power loss after a rename cannot leave the new name on a file still in memory only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON so that a reader sees either the old file or the whole new one."""
    _write_atomic(path, "w", lambda f: json.dump(data, f, indent=2, sort_keys=True))


def write_npz_atomic(path: Path, arrays: dict) -> None:
    """Write compressed numpy arrays so that a reader sees either the old file or the whole new one."""
    import numpy as np

    _write_atomic(path, "wb", lambda f: np.savez_compressed(f, **arrays))


def _write_atomic(path: Path, mode: str, write: Callable[[IO], None]) -> None:
    """`write` into a temporary file beside `path`, flushed to the disk, then renamed over it. A link
    is written through (its target is replaced, not the link), and what is not a regular file (a
    pipe, /dev/stdout) is written in place: nothing may be renamed over it."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with open(target, mode) as f:
            write(f)
        return
    fd, tmp = temporary_beside(target)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
