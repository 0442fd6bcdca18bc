"""Checking a store's files against its manifest without loading it, and the error that names the
command repairing a store (`mira convert` over an existing store rewrites what is missing or corrupt)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mira.errors import MiraError
from mira.store.files import sha256_file
from mira.store.manifest import Manifest

MAX_WORKERS = 8


def corrupt(store: Path, manifest: Manifest, what: str) -> MiraError:
    return MiraError(f"store {store} is corrupt: {what}; repair it with `{manifest.repair_command(store)}`")


def file_problems(store: Path, manifest: Manifest) -> dict[str, str]:
    """{relative path: what is wrong} for every file of the manifest that is missing or differs from its
    checksum; empty for a sound store. Files are hashed in parallel (sha256 releases the GIL)."""
    def problem(item: tuple[str, str]) -> str | None:
        rel, expected = item
        path = store / rel
        if not path.is_file():
            return "is missing"
        return None if sha256_file(path) == expected else "does not match its checksum"

    with ThreadPoolExecutor(min(MAX_WORKERS, os.cpu_count() or 1)) as pool:
        found = list(pool.map(problem, manifest.files.items()))
    return {rel: what for rel, what in zip(manifest.files, found) if what is not None}
